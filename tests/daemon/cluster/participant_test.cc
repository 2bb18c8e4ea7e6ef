// The participant, in-process with real coordinators, parity and data planes, and fakes at the
// store, peer-client, decision-log and election seams: it acts only on decisions the log holds,
// catches up on one it missed before it takes part in the next step, refuses to encode against any
// base but the decided one (so parity cannot diverge), refuses a deposed coordinator's token, an
// image of itself it did not report and a step its journal could not hold, and rebuilds rather
// than journal a commit it did not encode.
#include "daemon/cluster/participant.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cluster/image_patch.h"
#include "tests/daemon/cluster/in_process_cluster.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

using testing::InProcessCluster;

constexpr uint64_t kBytes = 300000;
// Captured with this much of kBytes unchanged, a node's image holds two regions, one of them
// changed at each step: Encode requests carry it as a patch.
constexpr uint64_t kKept = 200000;

// Every node committed exactly `steps`, in order.
void ExpectCommittedEverywhere(InProcessCluster& cluster, const std::vector<int64_t>& steps) {
  for (int node = 0; node < cluster.size(); ++node) {
    EXPECT_EQ(cluster.node(node).store.commits(), steps) << "node " << node;
  }
}

// `step`, captured everywhere (the first `kept_bytes` unchanged), is aborted for a reason that
// names each of `named`.
void ExpectAbortedNaming(InProcessCluster& cluster, int64_t step,
                         const std::vector<std::string>& named, uint64_t kept_bytes = 0) {
  cluster.CaptureEverywhere(step, kBytes, kept_bytes);
  std::optional<v1::StepDecision> decision = cluster.WaitDecided(step);
  ASSERT_TRUE(decision.has_value());
  EXPECT_FALSE(decision->committed());
  for (const std::string& words : named) {
    EXPECT_TRUE(absl::StrContains(decision->reason(), words)) << decision->reason();
  }
}

// `step`, captured everywhere (the first `kept_bytes` unchanged), commits everywhere, where every
// node has then committed `committed`, and every node's parity decodes.
void ExpectCommitsEverywhere(InProcessCluster& cluster, int64_t step,
                             const std::vector<int64_t>& committed, uint64_t kept_bytes = 0) {
  cluster.CaptureEverywhere(step, kBytes, kept_bytes);
  ASSERT_TRUE(cluster.WaitCommitted(step));
  ExpectCommittedEverywhere(cluster, committed);
  cluster.ExpectEveryNodeRebuildable(step, kBytes);
}

// What each step's Encode requests carried, as (image patches, regions sent) per request, while it
// lives; `alter` may rewrite a request to node `to` before it is served.
class EncodesSent {
 public:
  using Sent = std::vector<std::pair<int, int>>;
  static Sent Each(int requests, std::pair<int, int> sent) { return Sent(requests, sent); }

  explicit EncodesSent(InProcessCluster& cluster,
                       std::function<void(uint32_t, v1::EncodeRequest&)> alter = {})
      : cluster_(cluster) {
    cluster_.network().SetEncodeRewrite([this, alter](uint32_t, uint32_t to,
                                                      v1::EncodeRequest& request) {
      int regions = 0;
      for (const std::string& bytes : request.group_images()) {
        v1::NodeImage image;
        EXPECT_TRUE(image.ParseFromString(bytes));
        regions += image.regions_size();
      }
      {
        absl::MutexLock lock(&mutex_);
        sent_[request.step()].emplace_back(request.patches_size(), regions);
      }
      if (alter) alter(to, request);
    });
  }
  ~EncodesSent() { cluster_.network().SetEncodeRewrite(nullptr); }

  Sent Of(int64_t step) {
    absl::MutexLock lock(&mutex_);
    return sent_[step];
  }

 private:
  InProcessCluster& cluster_;
  absl::Mutex mutex_;
  std::map<int64_t, Sent> sent_;
};

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
  const auto rewrite = [&cluster](uint32_t, uint32_t to, v1::EncodeRequest& request) {
    // The coordinator holds this image of the receiver, and sends it as it sends any: as a patch
    // on the base step where it has one, else whole.
    const std::shared_ptr<const v1::JournalCluster> record = cluster.node(to).store.ClusterRecord();
    for (int position = 0; position < request.group_images_size(); ++position) {
      v1::NodeImage image;
      ASSERT_TRUE(image.ParseFromString(request.group_images(position)));
      if (image.node_id() != to) continue;
      v1::ImagePatch* patch = nullptr;
      for (v1::ImagePatch& each : *request.mutable_patches()) {
        if (each.node_id() == to) patch = &each;
      }
      v1::NodeImage whole = image;
      if (patch != nullptr) {
        std::string bytes;
        whole = PatchedImage(record->group_images(position), {}, image, *patch, bytes).value();
      }
      // The region the step changed: a patch still names only it.
      v1::ImageRegion& region = *whole.mutable_regions(whole.regions_size() - 1);
      region.set_chunk_crcs(0, region.chunk_crcs(0) ^ 1);
      if (patch == nullptr) {
        *request.mutable_group_images(position) = ImageBytes(whole);
        continue;
      }
      std::string bytes;
      ImagePatchOf altered = PatchOf(record->group_images(position), {}, whole, bytes).value();
      *request.mutable_group_images(position) = ImageBytes(altered.changes);
      *patch = altered.patch;
    }
  };
  cluster.network().SetEncodeRewrite(rewrite);
  // Sent whole: each node's image is one region, changed.
  ASSERT_NO_FATAL_FAILURE(ExpectAbortedNaming(cluster, 2, {"differs from the one it prepared"}));
  cluster.network().SetEncodeRewrite(nullptr);
  ASSERT_NO_FATAL_FAILURE(ExpectCommitsEverywhere(cluster, 3, {1, 3}));
  // Sent as a patch: two regions, one changed since step 4.
  ASSERT_NO_FATAL_FAILURE(ExpectCommitsEverywhere(cluster, 4, {1, 3, 4}, kKept));
  cluster.network().SetEncodeRewrite(rewrite);
  ASSERT_NO_FATAL_FAILURE(
      ExpectAbortedNaming(cluster, 5, {"differs from the one it prepared"}, kKept));
  cluster.network().SetEncodeRewrite(nullptr);
  ASSERT_NO_FATAL_FAILURE(ExpectCommitsEverywhere(cluster, 6, {1, 3, 4, 6}, kKept));
}

// A coordinator that sends an image at another member's position, or a patch whose image, built,
// is not a valid one (its regions do not add up to its size; the patch's CRC is that image's, so
// only the check of the built image can tell), is refused: the step aborts naming why, and the
// next step commits everywhere with parity that decodes.
TEST(ParticipantTest, AnEncodeWhoseImagesAreMisplacedOrBuildInvalidIsRefused) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  // Sent whole: the first two members' images trade places.
  cluster.network().SetEncodeRewrite([](uint32_t, uint32_t, v1::EncodeRequest& request) {
    if (request.patches_size() == 0) request.mutable_group_images()->SwapElements(0, 1);
  });
  ASSERT_NO_FATAL_FAILURE(ExpectAbortedNaming(cluster, 2, {"image 0 is node 1's, not node 0's"}));
  cluster.network().SetEncodeRewrite(nullptr);
  ASSERT_NO_FATAL_FAILURE(ExpectCommitsEverywhere(cluster, 3, {1, 3}));
  ASSERT_NO_FATAL_FAILURE(ExpectCommitsEverywhere(cluster, 4, {1, 3, 4}, kKept));
  // Sent as patches: each member's image says one byte more than its regions hold.
  cluster.network().SetEncodeRewrite([&cluster](uint32_t, uint32_t to, v1::EncodeRequest& request) {
    const std::shared_ptr<const v1::JournalCluster> record = cluster.node(to).store.ClusterRecord();
    for (v1::ImagePatch& patch : *request.mutable_patches()) {
      const int position = static_cast<int>(patch.node_id() % 6);
      ASSERT_EQ(record->group_images(position).node_id(), patch.node_id());
      v1::NodeImage changes;
      ASSERT_TRUE(changes.ParseFromString(request.group_images(position)));
      std::string bytes;
      v1::NodeImage whole =
          PatchedImage(record->group_images(position), {}, changes, patch, bytes).value();
      whole.set_bytes(whole.bytes() + 1);
      ImagePatchOf altered = PatchOf(record->group_images(position), {}, whole, bytes).value();
      *request.mutable_group_images(position) = ImageBytes(altered.changes);
      patch = altered.patch;
    }
  });
  ASSERT_NO_FATAL_FAILURE(ExpectAbortedNaming(cluster, 5, {"add up"}, kKept));
  cluster.network().SetEncodeRewrite(nullptr);
  ASSERT_NO_FATAL_FAILURE(ExpectCommitsEverywhere(cluster, 6, {1, 3, 4, 6}, kKept));
}

// After a step its coordinator committed, each Encode request carries every member's image as the
// regions it changed since (here the one of two regions each node's trainer captured anew), and
// every node builds the same images from its record: the step commits and every node's parity
// decodes. A new coordinator, which committed no base, sends them whole.
TEST(ParticipantTest, EncodesAfterACommitCarryEachMembersChangedRegionsOnly) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes, kKept);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  EncodesSent sent(cluster);
  cluster.CaptureEverywhere(2, kBytes, kKept);
  ASSERT_TRUE(cluster.WaitCommitted(2));
  cluster.election().Elect(1);
  cluster.CaptureEverywhere(3, kBytes, kKept);
  ASSERT_TRUE(cluster.WaitCommitted(3));
  EXPECT_EQ(sent.Of(2), EncodesSent::Each(6, {6, 6}));
  EXPECT_EQ(sent.Of(3), EncodesSent::Each(6, {0, 12}));
  ExpectCommittedEverywhere(cluster, {1, 2, 3});
  cluster.ExpectEveryNodeRebuildable(3, kBytes);
}

// Step after step sent as patches, each node builds every member's image in the memory of the
// record its base replaced, copying there the regions the base changed alone; here each step
// captures other regions anew than the step before. Each commit's images are the bytes its
// journal takes (the store checks them), every node commits every step, and parity decodes to
// what each node captured.
TEST(ParticipantTest, StepAfterStepOfPatchesBuildsTheImagesCapturedInReusedMemory) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  constexpr int kStateRegions = 10;
  for (int node = 0; node < cluster.size(); ++node) {
    cluster.node(node).store.SplitState(kStateRegions);
    cluster.node(node).store.RecaptureOnly(
        [](int region, int64_t step) { return region % 3 == step % 3; });
  }
  cluster.CaptureEverywhere(1, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  EncodesSent sent(cluster);
  std::vector<int64_t> committed = {1};
  for (int64_t step = 2; step <= 7; ++step) {
    cluster.CaptureEverywhere(step, kBytes);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << step;
    committed.push_back(step);
    ExpectCommittedEverywhere(cluster, committed);
    // Three or four of ten regions changed on every node, each request carrying them all.
    const int changed = step % 3 == 0 ? 4 : 3;
    EXPECT_EQ(sent.Of(step), EncodesSent::Each(6, {6, 6 * changed})) << step;
  }
  // (A rebuild installs a record of its own: the next step would build in memory it knows
  // nothing of.)
  cluster.ExpectEveryNodeRebuildable(7, kBytes);
}

// A receiver whose record of the base step is not its coordinator's (here: the CRC the patch
// names differs) builds nothing on it: the step aborts naming why, the coordinator sends the next
// step's images whole, and that step commits everywhere with parity that decodes.
TEST(ParticipantTest, APatchThatDoesNotBuildTheCoordinatorsImageAbortsAndTheNextStepGoesWhole) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  cluster.CaptureEverywhere(1, kBytes, kKept);
  ASSERT_TRUE(cluster.WaitCommitted(1));
  EncodesSent sent(cluster, [](uint32_t to, v1::EncodeRequest& request) {
    if (request.step() == 2 && to == 3 && request.patches_size() > 0) {
      request.mutable_patches(0)->set_image_crc(request.patches(0).image_crc() ^ 1);
    }
  });
  ASSERT_NO_FATAL_FAILURE(
      ExpectAbortedNaming(cluster, 2, {"node 3", "is not the coordinator's"}, kKept));
  ASSERT_NO_FATAL_FAILURE(ExpectCommitsEverywhere(cluster, 3, {1, 3}, kKept));
  ASSERT_NO_FATAL_FAILURE(ExpectCommitsEverywhere(cluster, 4, {1, 3, 4}, kKept));
  EXPECT_FALSE(sent.Of(2).empty());
  EXPECT_EQ(sent.Of(3), EncodesSent::Each(6, {0, 12}));
  EXPECT_EQ(sent.Of(4), EncodesSent::Each(6, {6, 6}));
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
