// The coordinator, in-process with real participants, parity and data planes, and fakes at the
// store, peer-client, decision-log and election seams: every step gets one fenced decision, a
// deposed coordinator's decision is refused and the next one finishes the step everywhere, a lost
// node aborts steps and is named, one node's failure aborts a step at once (an invalid answer to a
// Prepare too), and an unreachable log pauses commits without losing a step. A proposal is only a
// hint: one far ahead holds nothing up, one this node passed is aborted at once; but a step nodes
// hold open (under this coordinator or a dead one) is aborted once the commit timeout passes if
// this node never captures it, and passes no earlier step over. Deltas of units longer than a frame
// update parity exactly.
#include "daemon/cluster/coordinator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "tests/daemon/cluster/in_process_cluster.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

using testing::InProcessCluster;

constexpr uint64_t kBytes = 300000;  // about 4.6 stripe units of 64 KiB per node

bool Contains(const std::vector<int64_t>& steps, int64_t step) {
  return std::find(steps.begin(), steps.end(), step) != steps.end();
}

// Each step captures every byte again, so steps 2 to 5 encode every stripe afresh from the new
// units (StepChanges); the last one's parity must decode every node's data.
TEST(CoordinatorTest, EveryStepCommitsEverywhereOnOneFencedDecisionAndOldOnesAreDropped) {
  InProcessCluster cluster(6, 4, 2);
  const int64_t token = cluster.election().Elect(0);
  for (int64_t step = 1; step <= 5; ++step) {
    cluster.CaptureEverywhere(step, kBytes);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  const std::map<int64_t, v1::StepDecision> decisions = cluster.log().decisions();
  for (const auto& [step, decision] : decisions) {
    EXPECT_TRUE(decision.committed()) << "step " << step;
    EXPECT_EQ(decision.token(), token) << "step " << step;
  }
  // One write per step, and one that dropped the decisions no node needs (every 4 commits here).
  EXPECT_EQ(cluster.log().writes(), 5 + 1);
  EXPECT_FALSE(decisions.contains(1));
  EXPECT_TRUE(decisions.contains(5));
  uint64_t fresh = 0;
  uint64_t updated = 0;
  for (uint32_t id = 0; id < 6; ++id) {
    fresh += cluster.node(id).parity.openings().fresh;
    updated += cluster.node(id).parity.openings().updated;
  }
  EXPECT_GT(fresh, 0u);
  EXPECT_EQ(updated, 0u);
  cluster.ExpectEveryNodeRebuildable(5, kBytes);
}

// A delta is computed and sent a frame at a time: with stripe units of two and a half frames, a
// unit's delta goes as two whole frames and a short one (a node's last unit, shorter still, as one
// short frame), and the parity they update decodes every node's data. The nodes keep different
// parts of their state, so each step has a stripe of every kind: (2,1) over three units per node,
// stripe 0 holds two kept units (shared), stripes 1 and 2 a changed whole unit beside a kept one
// and stripe 3 a changed last unit beside a kept one (deltas), stripe 4 node 0's changed last
// unit beside nothing (encoded afresh).
TEST(CoordinatorTest, DeltasOfUnitsLongerThanAFrameUpdateTheParityExactly) {
  constexpr uint64_t kUnit = Transfer::kFrameBytes * 5 / 2;
  constexpr uint64_t kLarge = 2 * kUnit + (300 << 10) + 7;
  const std::map<uint32_t, uint64_t> kept = {{0, 0}, {1, 2 * kUnit}, {2, kLarge}};
  InProcessCluster cluster(3, 2, 1, /*allow_degraded=*/false, kUnit);
  cluster.election().Elect(0);
  std::map<uint32_t, ParityStore::Openings> before;
  for (int64_t step = 1; step <= 3; ++step) {
    if (step == 2) {
      for (uint32_t id = 0; id < 3; ++id) before[id] = cluster.node(id).parity.openings();
    }
    for (uint32_t id = 0; id < 3; ++id) {
      cluster.node(id).store.Capture(step, kLarge, {}, kept.at(id));
    }
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  ParityStore::Openings opened;
  for (uint32_t id = 0; id < 3; ++id) {
    EXPECT_EQ(cluster.node(id).participant.delta_encodes(), 2u) << "node " << id;
    const ParityStore::Openings now = cluster.node(id).parity.openings();
    opened.fresh += now.fresh - before[id].fresh;
    opened.updated += now.updated - before[id].updated;
    opened.shared += now.shared - before[id].shared;
    opened.whole += now.whole - before[id].whole;
  }
  // Two steps of one shared, three updated and one fresh unit each, and nothing encoded whole.
  EXPECT_EQ(opened.shared, 2u);
  EXPECT_EQ(opened.updated, 6u);
  EXPECT_EQ(opened.fresh, 2u);
  EXPECT_EQ(opened.whole, 0u);
  cluster.ExpectEveryNodeRebuildable(3, kLarge);
}

TEST(CoordinatorTest, DecisionsOfStepsRecordedAsDurableAreNotDropped) {
  InProcessCluster cluster(6, 4, 2);
  cluster.records().set_oldest(2);  // some node records step 2 as durable
  cluster.election().Elect(0);
  for (int64_t step = 1; step <= 9; ++step) {
    cluster.CaptureEverywhere(step, kBytes);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  // Drops at the 4th and 8th commits, each kept from step 2 on.
  ASSERT_TRUE(cluster.WaitLogWrites(9 + 2));
  EXPECT_EQ(cluster.log().writes(), 9 + 2);
  std::map<int64_t, v1::StepDecision> decisions = cluster.log().decisions();
  EXPECT_FALSE(decisions.contains(1));
  EXPECT_TRUE(decisions.contains(2));
  // Once no record lists a step before 9, the next drop goes as far as before.
  cluster.records().set_oldest(9);
  for (int64_t step = 10; step <= 12; ++step) {
    cluster.CaptureEverywhere(step, kBytes);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  ASSERT_TRUE(cluster.WaitLogWrites(12 + 3));  // the drop at the 12th commit
  decisions = cluster.log().decisions();
  EXPECT_FALSE(decisions.contains(2));
  EXPECT_TRUE(decisions.contains(9));
  EXPECT_FALSE(decisions.contains(8));
}

// The first failure: a coordinator that looked lost (paused past its lease) still runs.
// Its decision is refused by the fence, the new coordinator runs the step again under its own
// token, and every node commits it; none aborts it.
TEST(CoordinatorTest, ADeposedCoordinatorsDecisionIsRefusedAndTheNextOneFinishesTheStep) {
  InProcessCluster cluster(6, 4, 2);
  const int64_t old_token = cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  std::atomic<bool> deposed{false};
  int64_t new_token = 0;
  cluster.log().BeforeDecide([&](const v1::StepDecision& decision) {
    // Node 0 has prepared and encoded step 2 everywhere, and pauses before deciding it: meanwhile
    // its lease ends and node 1 is elected.
    if (decision.step() == 2 && decision.token() == old_token && !deposed.exchange(true)) {
      new_token = cluster.election().Elect(1);
    }
  });
  cluster.CaptureEverywhere(2, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(2));
  ASSERT_TRUE(deposed);
  const v1::StepDecision decision = cluster.log().decisions().at(2);
  EXPECT_TRUE(decision.committed());
  EXPECT_EQ(decision.token(), new_token);
  EXPECT_EQ(decision.coordinator(), 1u);
  for (int node = 0; node < cluster.size(); ++node) {
    EXPECT_FALSE(Contains(cluster.node(node).store.aborted(), 2)) << "node " << node;
  }
  // Whatever node 0 still sends under its old token is refused, and says why.
  v1::PrepareRequest late;
  late.set_coordinator(0);
  late.set_step(3);
  late.set_token(old_token);
  late.set_timeout_ms(100);
  absl::StatusOr<v1::PrepareResponse> refused = cluster.node(3).participant.Prepare(late);
  ASSERT_STATUS(refused, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "was deposed")) << refused.status();
  cluster.ExpectEveryNodeRebuildable(2, kBytes);
}

TEST(CoordinatorTest, AProposalAheadOfThisNodeWaitsForItAndHoldsNoStepUp) {
  InProcessCluster cluster(6, 4, 2);
  const int64_t token = cluster.election().Elect(0);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (cluster.node(0).coordinator.token() != token && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(cluster.node(0).coordinator.token(), token) << "node 0 never led";
  v1::ProposeRequest far;
  far.set_from_node(3);
  far.set_step(int64_t{1} << 62);
  ASSERT_OK(cluster.node(0).coordinator.Propose(far));
  for (int64_t step = 1; step <= 2; ++step) {
    cluster.CaptureEverywhere(step, kBytes);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  EXPECT_FALSE(cluster.log().decisions().contains(far.step()))
      << "a round ran for a step no node captured";
}

// Waits until `coordinator` coordinates under `token` (proposals made before are refused) and
// every node has checked whether it is behind (until then, it proposes no image).
bool WaitReady(InProcessCluster& cluster, int64_t token, uint32_t coordinator = 0) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (cluster.node(coordinator).coordinator.token() != token) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  for (uint32_t node = 0; node < static_cast<uint32_t>(cluster.size()); ++node) {
    if (cluster.node(node).rebuilder.BehindAfterCheck(deadline)) return false;
  }
  return true;
}

// The proposals of `step` the coordinator took from `node`.
std::vector<v1::ProposeRequest> ProposalsOf(InProcessCluster& cluster, int64_t step,
                                            uint32_t node) {
  std::vector<v1::ProposeRequest> found;
  for (const v1::ProposeRequest& proposal : cluster.network().proposals()) {
    if (proposal.step() == step && proposal.from_node() == node) found.push_back(proposal);
  }
  return found;
}

// Waits until each of nodes [first, end) has proposed `step`.
bool WaitProposed(InProcessCluster& cluster, int64_t step, uint32_t first, uint32_t end) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  for (uint32_t node = first; node < end; ++node) {
    while (ProposalsOf(cluster, step, node).empty()) {
      if (absl::Now() >= deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  return true;
}

// Waits until each of nodes [first, end) has applied the abort of `step`.
bool WaitAborted(InProcessCluster& cluster, int64_t step, uint32_t first, uint32_t end) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  for (uint32_t node = first; node < end; ++node) {
    while (!Contains(cluster.node(node).store.aborted(), step)) {
      if (absl::Now() >= deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  return true;
}

// Every node but `coordinator`'s captures `step`; once the coordinator took each one's proposal,
// the coordinator's node captures it: its round begins with the other nodes' proposals in hand.
bool CaptureCoordinatorLast(InProcessCluster& cluster, int64_t step, uint32_t coordinator = 0,
                            uint64_t kept_bytes = 0) {
  for (uint32_t node = 0; node < static_cast<uint32_t>(cluster.size()); ++node) {
    if (node != coordinator) cluster.node(node).store.Capture(step, kBytes, {}, kept_bytes);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  for (uint32_t node = 0; node < static_cast<uint32_t>(cluster.size()); ++node) {
    while (node != coordinator && ProposalsOf(cluster, step, node).empty()) {
      if (absl::Now() >= deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  cluster.node(coordinator).store.Capture(step, kBytes, {}, kept_bytes);
  return true;
}

// Runs `check` on each proposal node 0 (the coordinator) took from another node, with words naming
// it: node 0's own round may have begun before its proposal.
void ForEachProposalOfTheOtherNodes(
    InProcessCluster& cluster,
    const std::function<void(const v1::ProposeRequest&, const std::string&)>& check) {
  for (const v1::ProposeRequest& proposal : cluster.network().proposals()) {
    if (proposal.from_node() == 0) continue;
    check(proposal,
          absl::StrCat("node ", proposal.from_node(), "'s proposal of step ", proposal.step()));
  }
}

// A node that captured a step on the committed step the round encodes against proposes it with its
// image: the coordinator takes that in place of the node's Prepare, and the steps commit with
// parity that decodes.
TEST(CoordinatorTest, AProposalBringingItsImageOnTheBaseStandsForTheNodesPrepare) {
  InProcessCluster cluster(6, 4, 2);
  ASSERT_TRUE(WaitReady(cluster, cluster.election().Elect(0)));
  std::atomic<int> prepared{0};  // Prepare calls to the nodes that proposed before the round
  cluster.network().SetFilter([&](uint32_t, uint32_t to, const std::string& name) {
    if (name == "Prepare" && to != 0) ++prepared;
    return absl::OkStatus();
  });
  for (int64_t step = 1; step <= 3; ++step) {
    ASSERT_TRUE(CaptureCoordinatorLast(cluster, step)) << "step " << step;
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  EXPECT_EQ(prepared, 0);
  ForEachProposalOfTheOtherNodes(cluster, [](const v1::ProposeRequest& proposal,
                                             const std::string& what) {
    v1::NodeImage image;
    EXPECT_TRUE(proposal.has_image() && image.ParseFromString(proposal.image())) << what;
    EXPECT_EQ(image.node_id(), proposal.from_node()) << what;
    EXPECT_EQ(proposal.has_committed_step(), proposal.step() > 1) << what;
    if (proposal.has_committed_step()) {
      EXPECT_EQ(proposal.committed_step(), proposal.step() - 1) << what;
    }
  });
  cluster.ExpectEveryNodeRebuildable(3, kBytes);
}

// After a committed step, a proposal carries the proposer's changes since it (here the one of its
// two regions the trainer captured anew): the coordinator builds the image on the one it committed
// and prepares nobody. A new coordinator, which committed none of them, prepares the nodes whose
// proposals it cannot build, and takes their changes again from the step it commits.
TEST(CoordinatorTest, ProposalsAfterACommitCarryTheirChangesAndStandForThePrepare) {
  constexpr uint64_t kKept = 200000;
  InProcessCluster cluster(6, 4, 2);
  ASSERT_TRUE(WaitReady(cluster, cluster.election().Elect(0)));
  std::atomic<uint32_t> coordinator{0};
  std::atomic<int> prepared{0};  // Prepare calls to the nodes that proposed before the round
  cluster.network().SetFilter([&](uint32_t, uint32_t to, const std::string& name) {
    if (name == "Prepare" && to != coordinator) ++prepared;
    return absl::OkStatus();
  });
  for (int64_t step = 1; step <= 3; ++step) {
    ASSERT_TRUE(CaptureCoordinatorLast(cluster, step, 0, kKept)) << "step " << step;
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  EXPECT_EQ(prepared, 0);
  ForEachProposalOfTheOtherNodes(cluster, [](const v1::ProposeRequest& proposal,
                                             const std::string& what) {
    EXPECT_EQ(proposal.has_patch(), proposal.step() > 1) << what;
    if (proposal.has_patch()) {
      EXPECT_EQ(proposal.patch().changed_size(), 1) << what;
      v1::NodeImage changes;
      EXPECT_TRUE(changes.ParseFromString(proposal.image())) << what;
      EXPECT_EQ(changes.regions_size(), 1) << what;
    }
  });
  coordinator = 1;
  ASSERT_TRUE(WaitReady(cluster, cluster.election().Elect(1), 1));
  ASSERT_TRUE(CaptureCoordinatorLast(cluster, 4, 1, kKept));
  ASSERT_TRUE(cluster.WaitCommitted(4));
  EXPECT_EQ(prepared, 5);
  ASSERT_TRUE(CaptureCoordinatorLast(cluster, 5, 1, kKept));
  ASSERT_TRUE(cluster.WaitCommitted(5));
  EXPECT_EQ(prepared, 5);
  cluster.ExpectEveryNodeRebuildable(5, kBytes);
}

// The coordinator builds each proposed image of a step in the memory of its image of the node two
// steps back, and copies there only the regions the base changed. Every step here captures other
// regions anew than the step before (3 or 4 of 10 per node), so a copy that skipped one would leave
// the coordinator's image of a node stale there. Its images are what it sends a prepared node's
// image against: from step 8 node 3's proposals are lost, and the coordinator sends node 3's image
// of step 8 as its changes since its own image of node 3 at step 7, which names exactly the regions
// node 3 captured anew, and no more, when that image is node 3's own.
TEST(CoordinatorTest, ImagesBuiltInTheMemoryOfTheStepBeforeTheBaseAreTheNodesOwn) {
  InProcessCluster cluster(6, 4, 2);
  ASSERT_TRUE(WaitReady(cluster, cluster.election().Elect(0)));
  constexpr int kStateRegions = 10;
  auto recaptured = [](int region, int64_t step) { return region % 3 == step % 3; };
  for (int node = 0; node < cluster.size(); ++node) {
    cluster.node(node).store.SplitState(kStateRegions);
    cluster.node(node).store.RecaptureOnly(recaptured);
  }
  for (int64_t step = 1; step <= 7; ++step) {
    ASSERT_TRUE(CaptureCoordinatorLast(cluster, step)) << "step " << step;
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  cluster.network().SetFilter([](uint32_t from, uint32_t, const std::string& name) {
    return from == 3 && name == "Propose" ? absl::UnavailableError("node 3's proposals are lost")
                                          : absl::OkStatus();
  });
  absl::Mutex mutex;
  std::vector<int> node3_changed;  // regions each Encode of step 8 names as node 3's changes
  cluster.network().SetEncodeRewrite([&](uint32_t, uint32_t, v1::EncodeRequest& request) {
    if (request.step() != 8) return;
    absl::MutexLock lock(&mutex);
    for (const v1::ImagePatch& patch : request.patches()) {
      if (patch.node_id() == 3) node3_changed.push_back(patch.changed_size());
    }
  });
  cluster.CaptureEverywhere(8, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(8));
  cluster.network().SetEncodeRewrite(nullptr);
  int expected = 0;
  for (int region = 0; region < kStateRegions; ++region) expected += recaptured(region, 8) ? 1 : 0;
  {
    absl::MutexLock lock(&mutex);
    EXPECT_EQ(node3_changed, std::vector<int>(6, expected));
  }
  cluster.ExpectEveryNodeRebuildable(8, kBytes);
}

// An image built on another committed step than the round's base is not taken, even under the
// coordinator's token: here node 3's proposal of step 2 is replaced by one whose image differs
// from what node 3 holds, on no committed step. The coordinator prepares node 3, and only node 3,
// and the step commits with node 3's own image.
TEST(CoordinatorTest, AProposalsImageOnAnotherStepThanTheBaseIsNotTakenAndItsNodeIsPrepared) {
  InProcessCluster cluster(6, 4, 2);
  const int64_t token = cluster.election().Elect(0);
  ASSERT_TRUE(WaitReady(cluster, token));
  ASSERT_TRUE(CaptureCoordinatorLast(cluster, 1));
  ASSERT_TRUE(cluster.WaitCommitted(1));
  std::map<uint32_t, int> prepared;  // Prepare calls of step 2 by node, all taken on one thread
  absl::Mutex mutex;
  cluster.network().SetFilter([&](uint32_t, uint32_t to, const std::string& name) {
    absl::MutexLock lock(&mutex);
    if (name == "Prepare") ++prepared[to];
    return absl::OkStatus();
  });
  for (uint32_t node = 1; node < 6; ++node) cluster.node(node).store.Capture(2, kBytes);
  ASSERT_TRUE(WaitProposed(cluster, 2, 1, 6)) << "nodes 1-5 did not all propose step 2";
  v1::ProposeRequest stale = ProposalsOf(cluster, 2, 3).front();
  ASSERT_TRUE(stale.has_image());
  ASSERT_EQ(stale.committed_step(), 1);
  stale.clear_committed_step();
  v1::NodeImage image;
  ASSERT_TRUE(image.ParseFromString(stale.image()));
  image.mutable_regions(0)->set_chunk_crcs(0, image.regions(0).chunk_crcs(0) ^ 1);
  stale.set_image(image.SerializeAsString());
  ASSERT_EQ(stale.token(), token);
  ASSERT_OK(cluster.node(0).coordinator.Propose(stale));
  cluster.node(0).store.Capture(2, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(2));
  {
    absl::MutexLock lock(&mutex);
    EXPECT_EQ(prepared[3], 1);
    for (uint32_t node : {1, 2, 4, 5}) EXPECT_EQ(prepared[node], 0) << "node " << node;
  }
  cluster.ExpectEveryNodeRebuildable(2, kBytes);
}

// A node that encoded a step and hears of a new coordinator before it hears the step's decision
// proposes the step again, to the new coordinator, without reopening it: the step it encoded stays
// open under the token it was decided under, and it commits that step itself (no rebuild).
TEST(CoordinatorTest, ANodeThatHearsOfANewCoordinatorBeforeADecisionKeepsTheStepItEncoded) {
  InProcessCluster cluster(6, 4, 2);
  ASSERT_TRUE(WaitReady(cluster, cluster.election().Elect(0)));
  ASSERT_TRUE(CaptureCoordinatorLast(cluster, 1));
  ASSERT_TRUE(cluster.WaitCommitted(1));
  cluster.log().Deafen(3);
  ASSERT_TRUE(CaptureCoordinatorLast(cluster, 2));
  ASSERT_TRUE(cluster.WaitCommitted(2, {0, 1, 2, 4, 5}));
  ASSERT_TRUE(WaitReady(cluster, cluster.election().Elect(1), 1));
  for (const absl::Time deadline = absl::Now() + absl::Seconds(20);
       ProposalsOf(cluster, 2, 3).size() < 2;) {
    ASSERT_LT(absl::Now(), deadline) << "node 3 did not propose step 2 to node 1";
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_FALSE(ProposalsOf(cluster, 2, 3).back().has_image());
  cluster.log().Hear(3);
  ASSERT_TRUE(CaptureCoordinatorLast(cluster, 3, 1));
  ASSERT_TRUE(cluster.WaitCommitted(3));
  EXPECT_EQ(cluster.node(3).store.commits(), (std::vector<int64_t>{1, 2, 3}));
  cluster.ExpectEveryNodeRebuildable(3, kBytes);
}

// A step captured while an earlier one is undecided is proposed without an image (the image would
// hold the step's bytes until its round, and it is built on a step that will not be the base):
// the coordinator prepares it, and both steps commit.
TEST(CoordinatorTest, AStepCapturedBehindAnUndecidedOneIsProposedWithoutItsImageAndPrepared) {
  InProcessCluster cluster(6, 4, 2);
  ASSERT_TRUE(WaitReady(cluster, cluster.election().Elect(0)));
  std::atomic<int> prepared{0};
  cluster.network().SetFilter([&](uint32_t, uint32_t to, const std::string& name) {
    if (name == "Prepare" && to != 0) ++prepared;
    return absl::OkStatus();
  });
  // Step 1's round waits for node 0's capture.
  for (uint32_t node = 1; node < 6; ++node) cluster.node(node).store.Capture(1, kBytes);
  for (uint32_t node = 1; node < 6; ++node) cluster.node(node).store.Capture(2, kBytes);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  std::map<int64_t, std::set<uint32_t>> with_image;
  std::map<int64_t, std::set<uint32_t>> without_image;
  while (without_image[1].size() + with_image[1].size() < 5 ||
         without_image[2].size() + with_image[2].size() < 5) {
    ASSERT_LT(absl::Now(), deadline) << "nodes 1-5 did not propose steps 1 and 2";
    absl::SleepFor(absl::Milliseconds(5));
    with_image.clear();
    without_image.clear();
    for (const v1::ProposeRequest& proposal : cluster.network().proposals()) {
      (proposal.has_image() ? with_image : without_image)[proposal.step()].insert(
          proposal.from_node());
    }
  }
  EXPECT_TRUE(with_image[2].empty()) << with_image[2].size() << " nodes sent step 2's image";
  cluster.node(0).store.Capture(1, kBytes);
  cluster.node(0).store.Capture(2, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(2));
  EXPECT_EQ(cluster.node(1).store.commits(), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(prepared, static_cast<int>(5 + without_image[1].size()));
  cluster.ExpectEveryNodeRebuildable(2, kBytes);
}

TEST(CoordinatorTest, AStepTheCoordinatorsNodePassedWithoutCapturingIsAbortedAtOnce) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  for (uint32_t node = 1; node < 6; ++node) cluster.node(node).store.Capture(1, kBytes);
  cluster.CaptureEverywhere(2, kBytes);
  const std::optional<v1::StepDecision> skipped = cluster.WaitDecided(1);
  ASSERT_TRUE(skipped.has_value());
  EXPECT_FALSE(skipped->committed());
  EXPECT_TRUE(absl::StrContains(skipped->reason(), "captured a later step and never this one"))
      << skipped->reason();
  ASSERT_TRUE(cluster.WaitCommitted(2));
}

// Nodes 2-5 capture step 2 and open it with their proposals to node 0, which dies before its round:
// its lease ends and node 1 leads. Node 1's trainers are gone with the job's, so its node never
// captures step 2, yet the nodes holding it open wait for its decision (their restores too). They
// propose it again to node 1 naming the token they hold it open under, and node 1 aborts it once
// the commit timeout has passed.
TEST(CoordinatorTest, AStepOpenedUnderADeadCoordinatorIsAbortedByTheNextOneOnceTheTimeoutPasses) {
  InProcessCluster cluster(6, 4, 2);
  const int64_t first = cluster.election().Elect(0);
  ASSERT_TRUE(WaitReady(cluster, first));
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  // Node 0 takes the proposals and leaves step 2's round for its own capture, which never comes.
  for (uint32_t node = 2; node < 6; ++node) cluster.node(node).store.Capture(2, kBytes);
  ASSERT_TRUE(WaitProposed(cluster, 2, 2, 6)) << "nodes 2-5 did not all propose step 2";
  for (uint32_t node = 2; node < 6; ++node) {
    ASSERT_TRUE(ProposalsOf(cluster, 2, node).front().has_image()) << "node " << node;
  }
  cluster.table().Remove(0);
  const absl::Time elected = absl::Now();
  ASSERT_TRUE(WaitReady(cluster, cluster.election().Elect(1), 1));
  const std::optional<v1::StepDecision> decision = cluster.WaitDecided(2);
  ASSERT_TRUE(decision.has_value()) << "step 2 was never decided";
  EXPECT_GE(absl::Now() - elected, absl::Milliseconds(InProcessCluster::kCommitTimeoutMs));
  EXPECT_FALSE(decision->committed());
  EXPECT_EQ(decision->coordinator(), 1u);
  EXPECT_TRUE(absl::StrContains(decision->reason(), "node 1 (the coordinator's) did not capture"))
      << decision->reason();
  for (uint32_t node = 2; node < 6; ++node) {
    EXPECT_NE(ProposalsOf(cluster, 2, node).back().token(), 0) << "node " << node;
  }
  EXPECT_TRUE(WaitAborted(cluster, 2, 2, 6)) << "nodes 2-5 did not all apply the abort of step 2";
}

// Nodes 1-5 capture step 2 and open it with their proposals; the coordinator's own trainers are
// gone (or restarting), so its node does not capture it. Once the commit timeout has passed since
// the first proposal opened it, the coordinator aborts it, naming itself, instead of holding the
// nodes (and their restores) forever; the next step commits.
TEST(CoordinatorTest, AStepOpenedElsewhereThatTheCoordinatorsNodeDoesNotCaptureIsAbortedInTime) {
  InProcessCluster cluster(6, 4, 2);
  ASSERT_TRUE(WaitReady(cluster, cluster.election().Elect(0)));
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  const absl::Time opened = absl::Now();
  for (uint32_t node = 1; node < 6; ++node) cluster.node(node).store.Capture(2, kBytes);
  const std::optional<v1::StepDecision> decision = cluster.WaitDecided(2);
  ASSERT_TRUE(decision.has_value()) << "step 2 was never decided";
  EXPECT_GE(absl::Now() - opened, absl::Milliseconds(InProcessCluster::kCommitTimeoutMs));
  EXPECT_FALSE(decision->committed());
  EXPECT_TRUE(absl::StrContains(decision->reason(), "node 0 (the coordinator's) did not capture"))
      << decision->reason();
  EXPECT_TRUE(WaitAborted(cluster, 2, 1, 6)) << "nodes 1-5 did not all apply the abort of step 2";
  cluster.CaptureEverywhere(3, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(3));
}

// A proposal far ahead of every node that claims to hold its step open is aborted once the commit
// timeout has passed, and passes no step before it over: those still commit.
TEST(CoordinatorTest, AProposalFarAheadHoldingItsStepOpenIsAbortedAndPassesNoStepOver) {
  InProcessCluster cluster(6, 4, 2);
  const int64_t token = cluster.election().Elect(0);
  ASSERT_TRUE(WaitReady(cluster, token));
  v1::ProposeRequest far;
  far.set_from_node(3);
  far.set_step(int64_t{1} << 62);
  far.set_token(token);
  const absl::Time proposed = absl::Now();
  ASSERT_OK(cluster.node(0).coordinator.Propose(far));
  const std::optional<v1::StepDecision> decision = cluster.WaitDecided(far.step());
  ASSERT_TRUE(decision.has_value()) << "the far step was never decided";
  EXPECT_FALSE(decision->committed());
  EXPECT_GE(absl::Now() - proposed, absl::Milliseconds(InProcessCluster::kCommitTimeoutMs));
  for (int64_t step = 1; step <= 2; ++step) {
    cluster.CaptureEverywhere(step, kBytes);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
}

// Only a node's lowest few steps held open get the commit-timeout abort; the next ones theirs only
// once they became its lowest: a peer claiming many steps open makes no more decisions per commit
// timeout than an honest node would.
TEST(CoordinatorTest, APeerClaimingManyStepsOpenGetsTheCommitTimeoutForItsLowestFewOnly) {
  InProcessCluster cluster(6, 4, 2);
  const int64_t token = cluster.election().Elect(0);
  ASSERT_TRUE(WaitReady(cluster, token));
  const absl::Duration timeout = absl::Milliseconds(InProcessCluster::kCommitTimeoutMs);
  // Node 3 claims more steps open, far ahead of the job, than a node can hold open; node 4 claims
  // one above all of them.
  constexpr int kTimed = Coordinator::kTimedOpenStepsPerNode;
  constexpr int kClaims = kTimed + 2;
  const int64_t far = int64_t{1} << 40;
  const absl::Time proposed = absl::Now();
  v1::ProposeRequest claim;
  claim.set_token(token);
  claim.set_from_node(3);
  for (int i = kClaims - 1; i >= 0; --i) {
    claim.set_step(far + i);
    ASSERT_OK(cluster.node(0).coordinator.Propose(claim));
  }
  claim.set_from_node(4);
  claim.set_step(far + kClaims);
  ASSERT_OK(cluster.node(0).coordinator.Propose(claim));
  // The lowest few of node 3's, and node 4's, are aborted once the commit timeout passed...
  for (int64_t step : {far, far + kTimed - 1, far + kClaims}) {
    const std::optional<v1::StepDecision> decision = cluster.WaitDecided(step);
    ASSERT_TRUE(decision.has_value()) << "step " << step << " was never decided";
    EXPECT_FALSE(decision->committed());
  }
  EXPECT_GE(absl::Now() - proposed, timeout);
  const std::map<int64_t, v1::StepDecision> decisions = cluster.log().decisions();
  EXPECT_EQ(decisions.size(), kTimed + 1);
  EXPECT_FALSE(decisions.contains(far + kTimed));
  // ...the job's steps commit meanwhile...
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  // ...and node 3's next ones wait a commit timeout from when they became its lowest.
  for (int64_t step = far + kTimed; step < far + kClaims; ++step) {
    const std::optional<v1::StepDecision> decision = cluster.WaitDecided(step);
    ASSERT_TRUE(decision.has_value()) << "step " << step << " was never decided";
    EXPECT_FALSE(decision->committed());
  }
  EXPECT_GE(absl::Now() - proposed, 2 * timeout);
}

TEST(CoordinatorTest, AStepTakenAgainAfterItsAbortIsDroppedAtOnce) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  // Node 5 captures step 2 and proposes it; the cluster aborts it (as a coordinator that met a
  // failure would).
  std::atomic<bool> proposed{false};
  cluster.network().SetFilter([&](uint32_t from, uint32_t, const std::string& name) {
    if (from == 5 && name == "Propose") proposed = true;
    return absl::OkStatus();
  });
  testing::FakeClusterStore& store = cluster.node(5).store;
  store.Capture(2, kBytes);
  for (int attempt = 0; !proposed; ++attempt) {
    ASSERT_LT(attempt, 500) << "node 5 never proposed step 2";
    absl::SleepFor(absl::Milliseconds(10));
  }
  const std::optional<std::pair<uint32_t, int64_t>> leader = cluster.election().leader();
  ASSERT_TRUE(leader.has_value());
  v1::StepDecision abort;
  abort.set_step(2);
  abort.set_committed(false);
  abort.set_token(leader->second);
  abort.set_coordinator(leader->first);
  abort.set_reason("a node failed");
  ASSERT_OK(cluster.log().Decide(abort));
  auto times_aborted = [&] {
    const std::vector<int64_t> steps = store.aborted();
    return std::count(steps.begin(), steps.end(), 2);
  };
  for (int attempt = 0; times_aborted() < 1; ++attempt) {
    ASSERT_LT(attempt, 500) << "node 5 never applied the abort of step 2";
    absl::SleepFor(absl::Milliseconds(10));
  }
  // A replacement trainer replays step 2 after the abort, without restoring the whole rank (a
  // sparse window's replay): the step number is free again, and the new capture is dropped too.
  store.Capture(2, kBytes);
  for (int attempt = 0; times_aborted() < 2; ++attempt) {
    ASSERT_LT(attempt, 500) << "step 2, captured again, was never dropped";
    absl::SleepFor(absl::Milliseconds(10));
  }
  // It goes on to step 3, which it proposes once it has dealt with the decision of step 2.
  proposed = false;
  store.Capture(3, kBytes);
  for (int attempt = 0; !proposed; ++attempt) {
    ASSERT_LT(attempt, 500) << "node 5 never proposed step 3";
    absl::SleepFor(absl::Milliseconds(10));
  }
  // Node 5's trainer restores step 1 and takes step 2 again: the decision is final, so the new
  // capture is dropped instead of waiting for a decision that will never come.
  store.Rewind(1);
  store.Capture(2, kBytes);
  for (int attempt = 0; times_aborted() < 3; ++attempt) {
    ASSERT_LT(attempt, 500) << "step 2, taken again, was never dropped";
    absl::SleepFor(absl::Milliseconds(10));
  }
}

TEST(CoordinatorTest, AStepWhileANodeIsLostIsAbortedAndTheNodeNamed) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.table().Remove(5);  // its lease ended
  cluster.CaptureEverywhere(1, kBytes);
  std::optional<v1::StepDecision> decision = cluster.WaitDecided(1);
  ASSERT_TRUE(decision.has_value());
  EXPECT_FALSE(decision->committed());
  EXPECT_TRUE(absl::StrContains(decision->reason(), "node 5 of group 0 is lost")) << decision->reason();
  EXPECT_TRUE(WaitAborted(cluster, 1, 0, 5)) << "nodes 0-4 did not all apply the abort of step 1";
  for (int node = 0; node < 5; ++node) {
    EXPECT_EQ(cluster.node(node).participant.CommittedStep(), std::nullopt) << "node " << node;
  }
}

// Data-parallel ranks 0 and 1 (on nodes 0 and 1) form a replica group, each capturing a shard. A
// step commits only when both shards are of it: with rank 1's trainer gone, its node's record still
// holds its shard of the step before, and the step is aborted naming it instead of committing the
// group's pieces at two steps. Once rank 1 captures again, steps commit.
TEST(CoordinatorTest, AStepWhereAReplicaGroupMemberHoldsAnotherStepsShardIsAborted) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  auto layout = [](int64_t step) {
    v1::ReplicaGroupStep taken;
    taken.mutable_group()->set_name("data-parallel");
    taken.mutable_group()->add_ranks(0);
    taken.mutable_group()->add_ranks(1);
    taken.set_step(step);
    return taken;
  };
  auto capture = [&](int64_t step, int64_t rank_1_step) {
    for (uint32_t node = 0; node < 6; ++node) {
      std::vector<v1::ReplicaGroupStep> layouts;
      if (node == 0) layouts.push_back(layout(step));
      if (node == 1) layouts.push_back(layout(rank_1_step));
      cluster.node(node).store.Capture(step, kBytes, layouts);
    }
  };
  capture(1, 1);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  capture(2, 1);
  std::optional<v1::StepDecision> decision = cluster.WaitDecided(2);
  ASSERT_TRUE(decision.has_value());
  EXPECT_FALSE(decision->committed());
  EXPECT_TRUE(absl::StrContains(decision->reason(), "member rank 1 on node 1 holds its shard of step 1"))
      << decision->reason();
  capture(3, 3);
  ASSERT_TRUE(cluster.WaitCommitted(3));
}

// A node's answer to a Prepare is checked before the coordinator acts on it. Node 3's proposals
// are lost, so the coordinator prepares it, and its answer comes back with a region listing a chunk
// CRC more than its size has: the step is aborted naming node 3 and its image, not sent on to the
// group. Once node 3 answers with its own image, the next step commits.
TEST(CoordinatorTest, APrepareAnsweredWithAnInvalidImageAbortsTheStepNamingTheNode) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.network().SetFilter([](uint32_t from, uint32_t, const std::string& name) {
    return from == 3 && name == "Propose" ? absl::UnavailableError("node 3's proposals are lost")
                                          : absl::OkStatus();
  });
  std::atomic<int> rewritten{0};
  std::atomic<int> encodes{0};  // of step 1
  cluster.network().SetEncodeRewrite([&](uint32_t, uint32_t, v1::EncodeRequest& request) {
    if (request.step() == 1) ++encodes;
  });
  cluster.network().SetPrepareAnswerRewrite([&](uint32_t, uint32_t to, v1::PrepareResponse& answer) {
    if (to != 3 || answer.image().regions_size() == 0) return;
    answer.mutable_image()->mutable_regions(0)->add_chunk_crcs(0);
    ++rewritten;
  });
  cluster.CaptureEverywhere(1, kBytes);
  std::optional<v1::StepDecision> decision = cluster.WaitDecided(1);
  ASSERT_TRUE(decision.has_value());
  EXPECT_GT(rewritten, 0);
  EXPECT_FALSE(decision->committed());
  EXPECT_TRUE(absl::StrContains(decision->reason(),
                                "node 3 answered its Prepare of step 1 with an invalid image"))
      << decision->reason();
  EXPECT_EQ(encodes, 0);
  cluster.network().SetPrepareAnswerRewrite(nullptr);
  cluster.network().SetEncodeRewrite(nullptr);
  cluster.CaptureEverywhere(2, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(2));
  cluster.ExpectEveryNodeRebuildable(2, kBytes);
}

// A node whose Encode fails at once (its pool has no room for parity) never sends its data units,
// so the other parity holders would wait for them until the commit timeout (5 s here): the first
// failure aborts the step at once, the others end as they apply that decision, and the next step
// commits.
TEST(CoordinatorTest, OneNodesFailureAbortsTheStepWithoutWaitingOutTheCommitTimeout) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  cluster.network().SetFilter([](uint32_t, uint32_t to, const std::string& name) {
    return to == 3 && name == "Encode" ? absl::ResourceExhaustedError("no room for parity")
                                       : absl::OkStatus();
  });
  const absl::Time start = absl::Now();
  cluster.CaptureEverywhere(2, kBytes);
  std::optional<v1::StepDecision> decision = cluster.WaitDecided(2);
  ASSERT_TRUE(decision.has_value());
  EXPECT_FALSE(decision->committed());
  EXPECT_TRUE(absl::StrContains(decision->reason(), "node 3 did not store its parity"))
      << decision->reason();
  cluster.network().SetFilter([](uint32_t, uint32_t, const std::string&) { return absl::OkStatus(); });
  cluster.CaptureEverywhere(3, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(3));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(2500));
  cluster.ExpectEveryNodeRebuildable(3, kBytes);
}

// etcd out of reach: trainers go on capturing, nothing commits, and once it is back the steps
// commit by themselves.
TEST(CoordinatorTest, AnUnreachableLogPausesCommitsAndTheyResumeByThemselves) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  cluster.log().SetReachable(false);
  cluster.CaptureEverywhere(2, kBytes);
  cluster.CaptureEverywhere(3, kBytes);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  for (int node = 0; node < cluster.size(); ++node) {
    EXPECT_EQ(cluster.node(node).participant.CommittedStep(), 1) << "node " << node;
  }
  cluster.log().SetReachable(true);
  ASSERT_TRUE(cluster.WaitCommitted(3));
  EXPECT_TRUE(cluster.log().decisions().at(2).committed());
  cluster.ExpectEveryNodeRebuildable(3, kBytes);
}

}  // namespace
}  // namespace moesnap::daemon::cluster
