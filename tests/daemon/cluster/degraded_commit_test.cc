// Degraded commits (cluster.allow_degraded), in-process with real coordinators, participants,
// parity and data planes and fakes at the seams: with nodes of a group lost, steps commit on the
// live nodes with the lost ones named absent in the decision, their data frozen at their last
// committed image; the parity the live nodes hold stays consistent, so a replacement decodes
// exactly that image and every live node's data decodes too; more than m lost, no committed step
// to freeze, or a live node whose layout changed abort the step with the reason.
#include <gtest/gtest.h>

#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "daemon/cluster/coordinator.h"
#include "daemon/cluster/participant.h"
#include "tests/daemon/cluster/in_process_cluster.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

using testing::InProcessCluster;

constexpr uint64_t kBytes = 300000;  // about 4.6 stripe units of 64 KiB per node

void CaptureOn(InProcessCluster& cluster, const std::vector<uint32_t>& nodes, int64_t step,
               uint64_t bytes = kBytes) {
  for (uint32_t id : nodes) cluster.node(id).store.Capture(step, bytes);
}

std::vector<uint32_t> AbsentOf(const v1::StepDecision& decision) {
  return {decision.absent().begin(), decision.absent().end()};
}

// Decodes node `id`'s committed data from its group (as a replacement would) and compares it with
// `expected`; the node's own bytes are replaced by the decoded ones only if they are equal.
void ExpectDecodes(InProcessCluster& cluster, uint32_t id, int64_t step,
                   const std::vector<uint8_t>& expected) {
  absl::StatusOr<v1::RebuildResponse> rebuilt = cluster.node(id).rebuilder.RebuildHere();
  ASSERT_TRUE(rebuilt.ok()) << "node " << id << ": " << rebuilt.status();
  EXPECT_EQ(rebuilt->step(), step) << "node " << id;
  EXPECT_TRUE(cluster.node(id).store.CommittedBytesOf() == expected)
      << "node " << id << "'s data decoded from its group differs from what it captured";
}

// The scenario in one group of 4 + 2: node 5 is lost after step 1, steps 2-3 commit
// without it, node 4 is lost too, steps 4-5 commit without both. Each replacement decodes its
// node's last committed image (node 5's of step 1, node 4's of step 3) byte for byte, every live
// node's data of step 3 decodes from the group, and once both rejoin the next step commits with all.
TEST(DegradedCommitTest, StepsCommitWithLostNodesAndReplacementsRebuildTheirLastImages) {
  InProcessCluster cluster(6, 4, 2, /*allow_degraded=*/true);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));

  cluster.Lose(5);
  for (int64_t step = 2; step <= 3; ++step) {
    CaptureOn(cluster, {0, 1, 2, 3, 4}, step);
    ASSERT_TRUE(cluster.WaitCommitted(step, {0, 1, 2, 3, 4})) << "step " << step;
    const std::optional<v1::StepDecision> decision = cluster.WaitDecided(step);
    ASSERT_TRUE(decision.has_value());
    EXPECT_TRUE(decision->committed());
    EXPECT_EQ(AbsentOf(*decision), (std::vector<uint32_t>{5})) << "step " << step;
  }
  EXPECT_EQ(cluster.node(0).participant.latest_absent(), (std::vector<uint32_t>{5}));
  EXPECT_EQ(cluster.node(0).participant.degraded_commits(), 2u);
  // One node absent: any other one decodes from the rest.
  for (uint32_t id : {0u, 1u, 2u, 3u, 4u}) ExpectDecodes(cluster, id, 3, testing::StateOf(id, 3, kBytes));

  cluster.Lose(4);
  for (int64_t step = 4; step <= 5; ++step) {
    CaptureOn(cluster, {0, 1, 2, 3}, step);
    ASSERT_TRUE(cluster.WaitCommitted(step, {0, 1, 2, 3})) << "step " << step;
    const std::optional<v1::StepDecision> decision = cluster.WaitDecided(step);
    ASSERT_TRUE(decision.has_value());
    EXPECT_TRUE(decision->committed());
    EXPECT_EQ(AbsentOf(*decision), (std::vector<uint32_t>{4, 5})) << "step " << step;
  }

  // Two absent (m): the replacements decode from exactly the four live nodes' units, so the bytes
  // they get show that those units are consistent.
  cluster.Replace(5);
  cluster.Replace(4);
  for (uint32_t id : {4u, 5u}) {
    ASSERT_OK(cluster.node(id).rebuilder.WaitRestorable(absl::Now() + absl::Seconds(20)));
    EXPECT_EQ(cluster.node(id).participant.CommittedStep(), 5) << "node " << id;
  }
  EXPECT_TRUE(cluster.node(5).store.CommittedBytesOf() == testing::StateOf(5, 1, kBytes))
      << "node 5's replacement does not hold what node 5 committed last (step 1)";
  EXPECT_TRUE(cluster.node(4).store.CommittedBytesOf() == testing::StateOf(4, 3, kBytes))
      << "node 4's replacement does not hold what node 4 committed last (step 3)";

  cluster.CaptureEverywhere(6, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(6));
  EXPECT_TRUE(AbsentOf(*cluster.WaitDecided(6)).empty());
  EXPECT_TRUE(cluster.node(0).participant.latest_absent().empty());
  cluster.ExpectEveryNodeRebuildable(6, kBytes);
}

TEST(DegradedCommitTest, WithoutAllowDegradedALostNodeAbortsTheStepAndSaysHowToCommit) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  cluster.Lose(5);
  CaptureOn(cluster, {0, 1, 2, 3, 4}, 2);
  const std::optional<v1::StepDecision> decision = cluster.WaitDecided(2);
  ASSERT_TRUE(decision.has_value());
  EXPECT_FALSE(decision->committed());
  EXPECT_TRUE(absl::StrContains(decision->reason(), "node 5 of group 0 is lost")) << decision->reason();
  EXPECT_TRUE(absl::StrContains(decision->reason(), "cluster.allow_degraded")) << decision->reason();
}

TEST(DegradedCommitTest, MoreThanMLostNodesInAGroupAbortTheStepNamingThem) {
  InProcessCluster cluster(6, 4, 2, /*allow_degraded=*/true);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  for (uint32_t id : {3u, 4u, 5u}) cluster.Lose(id);
  CaptureOn(cluster, {0, 1, 2}, 2);
  const std::optional<v1::StepDecision> decision = cluster.WaitDecided(2);
  ASSERT_TRUE(decision.has_value());
  EXPECT_FALSE(decision->committed());
  EXPECT_TRUE(absl::StrContains(decision->reason(),
                                "group 0 has lost nodes [3, 4, 5], more than m = 2"))
      << decision->reason();
  for (uint32_t id : {0u, 1u, 2u}) {
    EXPECT_EQ(cluster.node(id).participant.CommittedStep(), 1) << "node " << id;
  }
}

TEST(DegradedCommitTest, ANodeLostBeforeAnyCommitAbortsTheStep) {
  InProcessCluster cluster(6, 4, 2, /*allow_degraded=*/true);
  cluster.election().Elect(0);
  cluster.Lose(5);
  CaptureOn(cluster, {0, 1, 2, 3, 4}, 1);
  const std::optional<v1::StepDecision> decision = cluster.WaitDecided(1);
  ASSERT_TRUE(decision.has_value());
  EXPECT_FALSE(decision->committed());
  EXPECT_TRUE(absl::StrContains(decision->reason(), "lost before any step committed"))
      << decision->reason();
}

// A live node whose image changed its layout (a rank registered a new region) needs a whole
// encode, which needs the absent node's units: the step aborts saying so, nothing diverges, and a
// later step with the old layout commits degraded again.
TEST(DegradedCommitTest, ALiveNodeThatChangedItsLayoutAbortsADegradedStep) {
  InProcessCluster cluster(6, 4, 2, /*allow_degraded=*/true);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  cluster.Lose(5);
  CaptureOn(cluster, {0, 1, 3, 4}, 2);
  CaptureOn(cluster, {2}, 2, kBytes + 4096);
  const std::optional<v1::StepDecision> decision = cluster.WaitDecided(2);
  ASSERT_TRUE(decision.has_value());
  EXPECT_FALSE(decision->committed());
  EXPECT_TRUE(absl::StrContains(decision->reason(), "cannot go as deltas")) << decision->reason();
  CaptureOn(cluster, {0, 1, 2, 3, 4}, 3);
  ASSERT_TRUE(cluster.WaitCommitted(3, {0, 1, 2, 3, 4}));
  for (uint32_t id : {0u, 1u, 2u, 3u, 4u}) ExpectDecodes(cluster, id, 3, testing::StateOf(id, 3, kBytes));
}

// The replacement of a lost node rebuilds while the job trains on. Its transfer is slow: the units
// it asked for have arrived, and the answers are held until the test lets them go. Steps 4-7
// commit meanwhile with it absent, as a parity receiver (before, each aborted: it was live and
// could not prepare). Once its rebuild of step 3 installs, it catches up through the four steps
// from the parity it received (its data, node 5's image of step 1, is the same in them), without
// another rebuild; step 8 commits with every node, and every node's data decodes from its group.
TEST(DegradedCommitTest, AReplacementRebuildsWhileStepsCommitAndCatchesUpFromTheParityItReceived) {
  InProcessCluster cluster(6, 4, 2, /*allow_degraded=*/true);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  cluster.Lose(5);
  for (int64_t step = 2; step <= 3; ++step) {
    CaptureOn(cluster, {0, 1, 2, 3, 4}, step);
    ASSERT_TRUE(cluster.WaitCommitted(step, {0, 1, 2, 3, 4})) << "step " << step;
  }

  absl::Notification release;
  cluster.network().SetUnitsServed([&release](uint32_t from, uint32_t) {
    if (from == 5) release.WaitForNotification();
  });
  // Runs before the cluster goes, whatever fails first.
  absl::Cleanup let_go = [&release] {
    if (!release.HasBeenNotified()) release.Notify();
  };
  cluster.Replace(5);
  // The rebuild registers every unit it needs before it asks for any: once all have arrived, it
  // holds step 3's units and waits for the answers.
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20);;) {
    const auto [slots, missing] = cluster.node(5).transfer.FetchesWaiting();
    if (slots > 0 && missing == 0) break;
    ASSERT_LT(absl::Now(), deadline) << "node 5's rebuild did not fetch its units";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int64_t step = 4; step <= 7; ++step) {
    CaptureOn(cluster, {0, 1, 2, 3, 4}, step);
    const std::optional<v1::StepDecision> decision = cluster.WaitDecided(step);
    ASSERT_TRUE(decision.has_value()) << "step " << step;
    ASSERT_TRUE(decision->committed()) << "step " << step << ": " << decision->reason();
    EXPECT_EQ(AbsentOf(*decision), (std::vector<uint32_t>{5})) << "step " << step;
    ASSERT_TRUE(cluster.WaitCommitted(step, {0, 1, 2, 3, 4})) << "step " << step;
  }
  // Node 5 may hear step 7's decision after nodes 0-4 applied it: wait until it has taken it.
  v1::NodeReport rebuilding = cluster.node(5).report.Describe();
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20);
       rebuilding.received_steps() < 4 && absl::Now() < deadline;
       rebuilding = cluster.node(5).report.Describe()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(rebuilding.rebuilding());
  EXPECT_EQ(rebuilding.received_steps(), 4u);
  EXPECT_FALSE(rebuilding.has_latest_committed_step());

  release.Notify();
  ASSERT_OK(cluster.node(5).rebuilder.WaitRestorable(absl::Now() + absl::Seconds(20)));
  EXPECT_EQ(cluster.node(5).participant.CommittedStep(), 7);
  EXPECT_EQ(cluster.node(5).rebuilder.caught_up_steps(), 4u);
  EXPECT_TRUE(cluster.node(5).store.CommittedBytesOf() == testing::StateOf(5, 1, kBytes))
      << "node 5's replacement does not hold what node 5 committed last (step 1)";
  EXPECT_EQ(cluster.node(5).report.Describe().received_steps(), 0u);

  cluster.CaptureEverywhere(8, kBytes);
  const std::optional<v1::StepDecision> decision = cluster.WaitDecided(8);
  ASSERT_TRUE(decision.has_value());
  ASSERT_TRUE(decision->committed()) << decision->reason();
  EXPECT_TRUE(AbsentOf(*decision).empty());
  ASSERT_TRUE(cluster.WaitCommitted(8));
  cluster.ExpectEveryNodeRebuildable(8, kBytes);
}

// A lost node that comes back with its memory (its lease had lapsed) learns that it was absent from
// the steps committed meanwhile and rebuilds: its data is its old image, its parity is brought up
// to date, and a later step commits on every node. While it catches up, steps commit without it
// (the first may abort: the node finds out it is behind only when it prepares).
TEST(DegradedCommitTest, ANodeThatComesBackAfterDegradedStepsRebuildsAndRejoins) {
  InProcessCluster cluster(6, 4, 2, /*allow_degraded=*/true);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  const NodeView registered = cluster.table().View(5);
  cluster.Lose(5);
  CaptureOn(cluster, {0, 1, 2, 3, 4}, 2);
  ASSERT_TRUE(cluster.WaitCommitted(2, {0, 1, 2, 3, 4}));
  cluster.network().Heal(5);
  cluster.log().Hear(5);
  cluster.table().Set(registered);
  // Steps commit without node 5 while it catches up (it does not hold step 2), then with it.
  bool rejoined = false;
  for (int64_t step = 3; step < 40 && !rejoined; ++step) {
    cluster.CaptureEverywhere(step, kBytes);
    const std::optional<v1::StepDecision> decision = cluster.WaitDecided(step);
    ASSERT_TRUE(decision.has_value()) << "step " << step;
    if (!decision->committed()) continue;
    rejoined = AbsentOf(*decision).empty();
    if (!rejoined) {
      EXPECT_EQ(AbsentOf(*decision), (std::vector<uint32_t>{5})) << "step " << step;
      continue;
    }
    ASSERT_TRUE(cluster.WaitCommitted(step));
    cluster.ExpectEveryNodeRebuildable(step, kBytes);
  }
  EXPECT_TRUE(rejoined) << "node 5 never rejoined";
}

// Groups code only their own nodes: a node lost in group 1 makes steps degraded there only; group
// 0's encodes name no one absent and every group 0 node stays fully protected (any two of them
// decode from the rest), while group 1's lost node decodes to its last image.
TEST(DegradedCommitTest, ALostNodeMakesOnlyItsOwnGroupDegraded) {
  InProcessCluster cluster(12, 4, 2, /*allow_degraded=*/true);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  cluster.Lose(9);
  const std::vector<uint32_t> live = {0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11};
  CaptureOn(cluster, live, 2);
  ASSERT_TRUE(cluster.WaitCommitted(2, live));
  EXPECT_EQ(AbsentOf(*cluster.WaitDecided(2)), (std::vector<uint32_t>{9}));
  for (uint32_t id : live) ExpectDecodes(cluster, id, 2, testing::StateOf(id, 2, kBytes));
  cluster.Replace(9);
  ASSERT_OK(cluster.node(9).rebuilder.WaitRestorable(absl::Now() + absl::Seconds(20)));
  EXPECT_TRUE(cluster.node(9).store.CommittedBytesOf() == testing::StateOf(9, 1, kBytes));
}

}  // namespace
}  // namespace moesnap::daemon::cluster
