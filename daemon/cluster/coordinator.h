// The coordinator: one node at a time, elected on etcd, runs each proposed step's commit:
//   prepare  every node reports its image of the step, unless its proposal brought it (a node
//            that captured the step on the round's base step proposes it with its image);
//   encode   every node sends its units (or its changes since the base step) to the parity holders
//            and answers once the parity it holds is complete;
//   decide   the step's outcome, committed or aborted, is written once to etcd in a transaction
//            that also requires this coordinator's leader key, so a deposed coordinator's decision
//            fails and a step can never be both. Every node acts on that key, not on any message.
// Every call carries the fencing token (the leader key's create revision); nodes refuse lower ones.
// A coordinator that loses its lease (crash, pause, partition) is deposed; the next one learns
// what is decided from etcd and runs again any step nodes propose that has no decision.
// With cluster.allow_degraded, a step commits while nodes are lost (at most m per group, after a
// first commit): the lost nodes are absent from it, their data frozen at their last committed
// image; the live nodes send their changes only (never a whole encode), and the decision names the
// absent nodes.
#ifndef MOESNAP_DAEMON_CLUSTER_COORDINATOR_H_
#define MOESNAP_DAEMON_CLUSTER_COORDINATOR_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/control.h"
#include "daemon/cluster_store.h"

namespace moesnap::daemon::cluster {

struct CoordinatorOptions {
  // Old decisions are dropped from the log once per this many committed steps.
  int forget_every = 64;
  // How long one campaign waits before looking whether to stop.
  absl::Duration campaign_wait = absl::Milliseconds(500);
};

// Thread-safe.
class Coordinator {
 public:
  // A node holds open at most the step it proposed with its image and the steps the rounds of
  // coordinators that died before deciding them prepared. So of the steps a node claims it holds
  // open, only its lowest this many wait for this node's capture at most the commit timeout (the
  // others wait their turn): a peer that claims steps far ahead open makes no more decisions than
  // an honest one whose coordinator's trainers are gone.
  static constexpr int kTimedOpenStepsPerNode = 4;

  // `store` is this node's: a proposed step's round waits until this node could prepare it.
  // `records` (null: none) are the nodes' durable records, whose steps' decisions are kept.
  Coordinator(const ClusterContext& context, Leadership* leadership, DecisionLog* log,
              const ClusterStore* store, DurableRecords* records,
              const CoordinatorOptions& options = {});
  ~Coordinator();  // stops after the round in progress, and steps down

  // Campaigns, and coordinates whenever this node leads.
  void Start();

  // A node captured `step`: its round runs unless the step is decided. A proposal is a hint, never
  // trusted: a step this node has not captured yet waits until it has (a commit needs every node's
  // capture), so a step far ahead of the job holds nothing up, and a step this node passed without
  // capturing is aborted at once. Proposals waiting are bounded; the furthest ahead give way.
  // The image a proposal brings stands for the node's Prepare when it was opened under this
  // coordinator's token on the round's base step; the images kept are bounded in bytes, those of
  // the steps furthest ahead giving way. A round waits up to kProposalWait for the proposals of
  // the live nodes that proposed the last round's step.
  // FAILED_PRECONDITION when this node does not coordinate.
  absl::StatusOr<v1::ProposeResponse> Propose(const v1::ProposeRequest& request);

  // The token this node coordinates under (0: it does not).
  int64_t token() const;
  // Decisions this coordinator wrote (for the per-step figures).
  uint64_t decisions() const { return decisions_; }

  // Fault injection: SIGKILL this process right after the decision of the first step at or after
  // `step` that commits is written to etcd (before any node acted on it).
  void set_crash_in_commit(int64_t step) { crash_in_commit_ = step; }

 private:
  // Leads under `token` until deposed or stopping.
  void Lead(int64_t token);
  // Runs `step`'s commit; false when this coordinator was deposed meanwhile.
  bool RunRound(int64_t step, int64_t token);
  // Writes `step`'s outcome (retrying while etcd cannot be reached), with the nodes absent from a
  // degraded commit; false when deposed.
  bool Decide(int64_t step, int64_t token, bool committed, const std::string& reason,
              const std::vector<uint32_t>& absent = {});
  // OK when a step may commit without the `lost` nodes (a degraded step): cluster.allow_degraded
  // is set, no group lost more than m, and a committed `base` holds their last images. Else why
  // the step aborts.
  absl::Status CheckDegraded(const std::vector<uint32_t>& lost,
                             const std::optional<int64_t>& base) const;
  bool stopping() const;
  // The lowest proposed step whose round may begin now, if any: this node captured it (or a node
  // holds it open and its wait for this node's capture ran out), and every live node that
  // proposed the last round's step proposed it, or kProposalWait passed since then. Lowers `wake`
  // to when a step waiting for proposals or for this node's capture stops waiting.
  std::optional<int64_t> NextRoundLocked(absl::Time* wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  // A proposal's image of its step, and the step its node had committed when it built it.
  struct ProposedImage {
    std::optional<int64_t> committed;
    v1::NodeImage image;  // with `patch`: the changes since `committed` it carries
    std::string image_bytes;  // without `patch`: as its proposer serialized it
    std::optional<v1::ImagePatch> patch;
    uint64_t bytes = 0;  // counted against the bound
  };
  // The proposals of a step whose round has not begun.
  struct StepProposals {
    std::vector<bool> proposers;  // by node id
    std::vector<bool> holders;    // the proposers that hold it open (under any token), by node id
    // The images the round may take (opened under token_), by node id.
    std::map<uint32_t, ProposedImage> images;
    // Since when this node has captured the step while a live node's proposal is missing.
    std::optional<absl::Time> waiting_since;
    // Since when the step has been among the lowest kTimedOpenStepsPerNode that one of its holders
    // holds open (NextRoundLocked).
    std::optional<absl::Time> open_since;
  };
  // Until when a step some node holds open waits for this node's capture (the commit timeout
  // after it became one of its holder's lowest); none when it does not wait so.
  std::optional<absl::Time> OwnCaptureDeadline(const StepProposals& proposals) const;
  // Keeps `request`'s image, parsed as `image`, among `proposals`' (in place of its node's earlier
  // one), within the bound.
  void KeepProposedImageLocked(const v1::ProposeRequest& request, v1::NodeImage image,
                               StepProposals& proposals) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Removes `step`'s proposals and returns them.
  StepProposals TakeProposalsLocked(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Drops `proposals`' images from the count and from memory.
  void ClearImagesLocked(StepProposals& proposals) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void DropProposedImagesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const ClusterContext context_;
  Leadership* const leadership_;
  DecisionLog* const log_;
  const ClusterStore* const store_;
  DurableRecords* const records_;
  const CoordinatorOptions options_;
  std::atomic<int64_t> crash_in_commit_{-1};
  std::atomic<uint64_t> decisions_{0};

  mutable absl::Mutex mutex_;
  absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  int64_t token_ ABSL_GUARDED_BY(mutex_) = 0;  // while leading
  std::map<int64_t, StepProposals> proposals_ ABSL_GUARDED_BY(mutex_);  // awaiting a round
  uint64_t proposed_image_bytes_ ABSL_GUARDED_BY(mutex_) = 0;  // of the images kept there
  // The nodes that proposed the last round's step by the time it began (none yet: every node).
  std::optional<std::vector<bool>> last_proposers_ ABSL_GUARDED_BY(mutex_);
  std::map<int64_t, bool> decided_ ABSL_GUARDED_BY(mutex_);  // step -> committed, as etcd holds
  std::optional<int64_t> base_ ABSL_GUARDED_BY(mutex_);  // the latest committed step
  std::optional<int64_t> last_round_ ABSL_GUARDED_BY(mutex_);
  int commits_since_forget_ ABSL_GUARDED_BY(mutex_) = 0;
  // The images of the last step this coordinator committed, by node, and that step: what the
  // next round's Encode requests patch (every member's record holds them alike). Used by the
  // leading thread only.
  std::map<uint32_t, v1::NodeImage> committed_images_;
  std::optional<int64_t> committed_images_step_;
  // Their bytes, as this coordinator sent them: the next round splices a patched image's bytes
  // from them, instead of serializing every region of it.
  std::map<uint32_t, std::string> committed_image_bytes_;
  // The images the last commit replaced there, and their bytes, whose memory the next round builds
  // its patched images in: a node of thousands of regions then allocates no entry anew each step.
  std::map<uint32_t, v1::NodeImage> spare_images_;
  std::map<uint32_t, std::string> spare_image_bytes_;
  // By node, where its committed image differs from its spare one, for those built on it (a
  // proposal's patch on the image this coordinator had committed, which the commit replaced): the
  // next round copies the committed image into the spare by those regions alone
  // (ImageMemory::differs_at). A node's entry goes with its spare's memory, and all go when the
  // committed images do.
  std::map<uint32_t, std::vector<uint32_t>> spare_differs_at_;
  // The images the commit after the last replaced in turn (spare images before it): whole
  // proposals are parsed into their memory, so that a dense step of thousands of regions allocates
  // no entry anew either.
  std::vector<v1::NodeImage> image_memory_ ABSL_GUARDED_BY(mutex_);
  std::thread loop_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_COORDINATOR_H_
