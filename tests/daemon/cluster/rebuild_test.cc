// The rebuilder, in-process with real participants, coordinators, parity and data planes, and fakes
// at the store, peer-client, decision-log and election seams: a replacement rebuilds the latest
// committed step; a failed rebuild is reported, keeps Restore refused only while the node lacks
// its data, and is tried again until it works; an operator's failed rebuild of a node that holds
// its data leaves that data restorable; more than m lost names the group and the step.
#include "daemon/cluster/rebuild.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "tests/daemon/cluster/in_process_cluster.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

using testing::InProcessCluster;

constexpr uint64_t kBytes = 300000;

void CommitSteps(InProcessCluster& cluster, int64_t last) {
  for (int64_t step = 1; step <= last; ++step) {
    cluster.CaptureEverywhere(step, kBytes);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
}

TEST(RebuildTest, AReplacementRebuildsTheLatestCommittedStepFromItsGroup) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  CommitSteps(cluster, 3);
  cluster.Replace(2);
  ASSERT_OK(cluster.node(2).rebuilder.WaitRestorable(absl::Now() + absl::Seconds(20)));
  EXPECT_EQ(cluster.node(2).participant.CommittedStep(), 3);
  EXPECT_TRUE(cluster.node(2).store.CommittedBytesOf() == testing::StateOf(2, 3, kBytes));
  // And it takes part again.
  cluster.CaptureEverywhere(4, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(4));
  cluster.ExpectEveryNodeRebuildable(4, kBytes);
}

// The fourth failure, first half: a failed rebuild used to be final until a restart.
TEST(RebuildTest, AFailedRebuildIsReportedAndTriedAgainUntilItWorks) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  CommitSteps(cluster, 2);
  // Exactly three fetches are refused. The rebuild fetches from several survivors at once, so the
  // count is compared and raised in one atomic step.
  std::atomic<int> refused{0};
  cluster.network().SetFilter([&](uint32_t from, uint32_t, const std::string& call) {
    if (from != 2 || call != "SendUnits") return absl::OkStatus();
    for (int seen = refused.load(); seen < 3;) {
      if (refused.compare_exchange_weak(seen, seen + 1)) {
        return absl::UnavailableError("a survivor restarted");
      }
    }
    return absl::OkStatus();
  });
  cluster.Replace(2);
  bool reported = false;
  absl::Status restorable;
  for (int attempt = 0; attempt < 400; ++attempt) {
    restorable = cluster.node(2).rebuilder.WaitRestorable(absl::Now() + absl::Milliseconds(50));
    if (restorable.ok()) break;
    reported = reported || absl::StrContains(restorable.message(), "a survivor restarted");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_OK(restorable);
  EXPECT_TRUE(reported) << "the failed attempts were not reported to Restore";
  EXPECT_EQ(refused, 3);
  EXPECT_TRUE(cluster.node(2).store.CommittedBytesOf() == testing::StateOf(2, 2, kBytes));
}

// The fourth failure, second half: a failed rebuild of a node whose data is intact used to
// refuse Restore of that data until the daemon restarted.
TEST(RebuildTest, AFailedRebuildOfANodeThatHoldsItsDataLeavesItRestorableAndInTheCluster) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  CommitSteps(cluster, 2);
  cluster.network().SetFilter([](uint32_t from, uint32_t, const std::string& call) {
    if (from == 1 && call == "SendUnits") return absl::DataLossError("a survivor's units are corrupt");
    return absl::OkStatus();
  });
  EXPECT_STATUS(cluster.node(1).rebuilder.RebuildHere(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(cluster.node(1).rebuilder.last_failure().message(), "corrupt"));
  EXPECT_OK(cluster.node(1).rebuilder.WaitRestorable(absl::Now()));
  EXPECT_TRUE(cluster.node(1).store.CommittedBytesOf() == testing::StateOf(1, 2, kBytes));
  cluster.network().SetFilter(nullptr);
  cluster.CaptureEverywhere(3, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(3));
}

TEST(RebuildTest, MoreThanMLostNamesTheGroupAndTheStepAndIsTriedAgain) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  CommitSteps(cluster, 2);
  cluster.network().Cut(3);
  cluster.network().Cut(4);
  cluster.Replace(0);
  absl::Status restorable = cluster.node(0).rebuilder.WaitRestorable(absl::Now() + absl::Seconds(20));
  ASSERT_STATUS(restorable, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(restorable.message(), "group 0 [0, 1, 2, 3, 4, 5] has lost nodes"))
      << restorable;
  EXPECT_TRUE(absl::StrContains(restorable.message(), "step 2 of node 0 can no longer be recovered"))
      << restorable;
  // A survivor that comes back makes the next attempt succeed.
  cluster.network().Heal(3);
  for (int attempt = 0; attempt < 400 && !restorable.ok(); ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    restorable = cluster.node(0).rebuilder.WaitRestorable(absl::Now());
  }
  ASSERT_OK(restorable);
  EXPECT_TRUE(cluster.node(0).store.CommittedBytesOf() == testing::StateOf(0, 2, kBytes));
}

}  // namespace
}  // namespace moesnap::daemon::cluster
