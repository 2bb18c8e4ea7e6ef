// The participant, in-process with real coordinators, parity and data planes, and fakes at the
// store, peer-client, decision-log and election seams: it acts only on decisions the log holds,
// catches up on one it missed before it takes part in the next step, refuses to encode against any
// base but the decided one (so parity cannot diverge), refuses a deposed coordinator's token, an
// image of itself it did not report and a step its journal could not hold, and rebuilds rather
// than journal a commit it did not encode.
#include "daemon/cluster/participant.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/daemon/cluster/in_process_cluster.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

using testing::InProcessCluster;

constexpr uint64_t kBytes = 300000;

// Every node committed exactly `steps`, in order.
void ExpectCommittedEverywhere(InProcessCluster& cluster, const std::vector<int64_t>& steps) {
  for (int node = 0; node < cluster.size(); ++node) {
    EXPECT_EQ(cluster.node(node).store.commits(), steps) << "node " << node;
  }
}

// `step`, captured everywhere, is aborted for a reason that names each of `named`.
void ExpectAbortedNaming(InProcessCluster& cluster, int64_t step,
                         const std::vector<std::string>& named) {
  cluster.CaptureEverywhere(step, kBytes);
  std::optional<v1::StepDecision> decision = cluster.WaitDecided(step);
  ASSERT_TRUE(decision.has_value());
  EXPECT_FALSE(decision->committed());
  for (const std::string& words : named) {
    EXPECT_TRUE(absl::StrContains(decision->reason(), words)) << decision->reason();
  }
}

// `step`, captured everywhere, commits everywhere, where every node has then committed
// `committed`, and every node's parity decodes.
void ExpectCommitsEverywhere(InProcessCluster& cluster, int64_t step,
                             const std::vector<int64_t>& committed) {
  cluster.CaptureEverywhere(step, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(step));
  ExpectCommittedEverywhere(cluster, committed);
  cluster.ExpectEveryNodeRebuildable(step, kBytes);
}

// The second failure: a node that never heard that step 1 committed (a lost commit
// message, a watch that lagged). It learns it from the log before it prepares step 2, so both steps
// commit everywhere and every node's parity decodes.
TEST(ParticipantTest, ANodeThatMissedADecisionCatchesUpFromTheLogBeforeTheNextStep) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.log().Deafen(3);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1, {0, 1, 2, 4, 5}));
  EXPECT_EQ(cluster.node(3).participant.CommittedStep(), std::nullopt);
  cluster.CaptureEverywhere(2, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(2, {0, 1, 2, 4, 5}));
  cluster.log().Hear(3);
  cluster.CaptureEverywhere(3, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(3));
  EXPECT_EQ(cluster.node(3).store.commits(), (std::vector<int64_t>{1, 2, 3}));
  cluster.ExpectEveryNodeRebuildable(3, kBytes);
}

// The third failure: parity bases diverging. A node that cannot learn the decision of the
// base step refuses to encode against anything else; the step is aborted, nothing diverges, and once
// the node reaches the log again the next step commits everywhere with parity that decodes.
TEST(ParticipantTest, ANodeRefusesToEncodeAgainstABaseItHasNotAppliedSoParityCannotDiverge) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.log().CutOff(3, true);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1, {0, 1, 2, 4, 5}));
  ASSERT_NO_FATAL_FAILURE(ExpectAbortedNaming(cluster, 2, {"node 3", "encodes against step 1"}));
  cluster.log().CutOff(3, false);
  ASSERT_NO_FATAL_FAILURE(ExpectCommitsEverywhere(cluster, 3, {1, 3}));
}

TEST(ParticipantTest, ATokenLowerThanOneSeenIsRefusedNamingTheNewerCoordinator) {
  InProcessCluster cluster(6, 4, 2);
  const int64_t first = cluster.election().Elect(0);
  const int64_t second = cluster.election().Elect(1);
  v1::PrepareRequest request;
  request.set_coordinator(0);
  request.set_step(1);
  request.set_token(first);
  request.set_timeout_ms(100);
  absl::StatusOr<v1::PrepareResponse> refused = cluster.node(2).participant.Prepare(request);
  ASSERT_STATUS(refused, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                absl::StrCat("token ", first, " is lower than token ", second,
                                             " of node 1")))
      << refused.status();
  v1::EncodeRequest encode;
  encode.set_coordinator(0);
  encode.set_step(1);
  encode.set_token(first);
  EXPECT_STATUS(cluster.node(2).participant.Encode(encode), absl::StatusCode::kFailedPrecondition);
}

TEST(ParticipantTest, ATokenNoLeaderHoldsIsRefusedAndTheRealCoordinatorGoesOn) {
  InProcessCluster cluster(6, 4, 2);
  const int64_t token = cluster.election().Elect(0);
  v1::PrepareRequest forged;
  forged.set_coordinator(3);
  forged.set_step(1);
  forged.set_token(token + 1000);
  forged.set_timeout_ms(100);
  absl::StatusOr<v1::PrepareResponse> refused = cluster.node(2).participant.Prepare(forged);
  ASSERT_STATUS(refused, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                absl::StrCat("etcd names node 0 as coordinator with token ", token)))
      << refused.status();
  forged.set_token(token);  // the leader's token, claimed by another node
  ASSERT_STATUS(cluster.node(2).participant.Prepare(forged), absl::StatusCode::kFailedPrecondition);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
}

// A coordinator that sends a node an image of itself other than the one it reported (here one
// chunk checksum altered) is refused: the node encodes nothing, the step aborts naming why, and
// the next step commits everywhere with parity that decodes.
TEST(ParticipantTest, AnEncodeCarryingAnotherImageOfTheNodeThanItReportedIsRefused) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  cluster.network().SetEncodeRewrite([](uint32_t, uint32_t to, v1::EncodeRequest& request) {
    for (v1::NodeImage& image : *request.mutable_group_images()) {
      if (image.node_id() == to && image.regions_size() > 0 &&
          image.regions(0).chunk_crcs_size() > 0) {
        v1::ImageRegion& region = *image.mutable_regions(0);
        region.set_chunk_crcs(0, region.chunk_crcs(0) ^ 1);
      }
    }
  });
  ASSERT_NO_FATAL_FAILURE(ExpectAbortedNaming(cluster, 2, {"differs from the one it prepared"}));
  cluster.network().SetEncodeRewrite(nullptr);
  ASSERT_NO_FATAL_FAILURE(ExpectCommitsEverywhere(cluster, 3, {1, 3}));
}

// A step whose commit one node's journal could not hold aborts before any parity moves, naming
// the node and the setting to raise, instead of committing everywhere but there; once the
// journal is large enough the next step commits everywhere.
TEST(ParticipantTest, AStepANodesJournalCannotHoldAbortsNamingTheNodeAndTheSetting) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  cluster.node(3).store.SetJournalBytes(1000);
  ASSERT_NO_FATAL_FAILURE(
      ExpectAbortedNaming(cluster, 2, {"node 3 cannot journal it", "pool.journal_bytes"}));
  cluster.node(3).store.SetJournalBytes(std::nullopt);
  ASSERT_NO_FATAL_FAILURE(ExpectCommitsEverywhere(cluster, 3, {1, 3}));
}

// A commit this node cannot take (decided under a token it did not encode under) is never
// journalled with parity it does not hold: the node rebuilds that step from its group.
TEST(ParticipantTest, ACommitItDidNotEncodeMakesTheNodeRebuildInsteadOfJournalingIt) {
  InProcessCluster cluster(6, 4, 2);
  const int64_t token = cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  cluster.log().Deafen(4);
  cluster.CaptureEverywhere(2, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(2, {0, 1, 2, 3, 5}));
  v1::StepDecision mismatched = cluster.log().decisions().at(2);
  ASSERT_EQ(mismatched.token(), token);
  mismatched.set_token(token + 1);
  cluster.node(4).participant.Apply(mismatched);
  ASSERT_TRUE(cluster.WaitCommitted(2, {4}));
  EXPECT_EQ(cluster.node(4).store.commits(), (std::vector<int64_t>{1}));  // step 2 came by rebuild
  EXPECT_TRUE(cluster.node(4).store.CommittedBytesOf() == testing::StateOf(4, 2, kBytes));
  EXPECT_OK(cluster.node(4).rebuilder.WaitRestorable(absl::Now() + absl::Seconds(5)));
}

}  // namespace
}  // namespace moesnap::daemon::cluster
