// A node's part in every step's commit. Once its trainers have captured a step it proposes the step
// to the coordinator (the leader etcd names, again whenever that changes); then, asked by the
// coordinator, each call carrying the coordinator's fencing token:
//   Prepare  waits until its trainers captured the step and reports its image (NodeImage); a
//            proposal carries that image when this node holds the base already, and the
//            coordinator then skips this call;
//   Encode   checks it has applied every decision up to the coordinator's base step (catching up
//            from etcd if it missed one), opens its parity units of the step, sends each of its
//            data units (or, for a step that keeps every node's layout, the changed ones: as their
//            deltas against the base, or as themselves in a stripe whose units all changed,
//            StepChanges) to the stripe's m parity holders, and answers once every unit it holds
//            has received all its data. In a degraded step the nodes named absent keep their
//            images of the base (this node's record has them): they change no unit, get nothing,
//            and the step cannot encode whole.
// With cluster.allow_degraded, a node that rebuilds (it does not hold the latest committed step)
// answers Prepare as absent instead of refusing, so steps go on committing without it; if its pool
// has room it is a parity receiver: its Encode (parity_only) sends nothing and accumulates the
// live nodes' deltas for the parity units it holds, from zero, against the group record of the
// base step (read from a member). On the commit of such a step the accumulation is kept, and the
// rebuilder folds it into the rebuilt parity: the node catches up without rebuilding again.
// It commits or aborts a step only on the decision etcd holds (Apply), never on a coordinator's
// word; a commit decided under a token it did not encode under, or of a step it never encoded,
// means this node is behind: it rebuilds from its group. A token lower than the highest this node
// has seen (from a call or from etcd) is refused: that coordinator was deposed.
#ifndef MOESNAP_DAEMON_CLUSTER_PARTICIPANT_H_
#define MOESNAP_DAEMON_CLUSTER_PARTICIPANT_H_

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
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/control.h"
#include "daemon/cluster/encode_images.h"
#include "daemon/cluster/rebuild.h"
#include "daemon/cluster/transfer.h"
#include "daemon/cluster_store.h"
#include "daemon/parity_store.h"
#include "daemon/step_changes.h"

namespace moesnap::daemon::cluster {

// Thread-safe.
class Participant {
 public:
  Participant(const ClusterContext& context, ClusterStore* store, ParityStore* parity,
              Transfer* transfer, Rebuilder* rebuilder, DecisionLog* log);
  ~Participant();  // stops proposing

  // Starts proposing every step this node's trainers capture.
  void Start();

  absl::StatusOr<v1::PrepareResponse> Prepare(const v1::PrepareRequest& request);
  absl::StatusOr<v1::EncodeResponse> Encode(const v1::EncodeRequest& request);
  // A decision the log holds, in any order and any number of times.
  void Apply(const v1::StepDecision& decision);

  std::optional<int64_t> CommittedStep() const;
  // The newest step opened here (prepared, or proposed with its image) and not decided yet.
  std::optional<int64_t> OpenStep() const;
  // The highest fencing token this node has seen.
  int64_t highest_token() const;
  // Why the latest aborted step failed ("step S: reason"), if any.
  std::string last_abort() const;
  // The nodes absent from the latest step this node committed (a degraded commit; empty: none).
  std::vector<uint32_t> latest_absent() const;
  // Degraded commits this node applied.
  uint64_t degraded_commits() const { return degraded_commits_; }
  uint64_t full_encodes() const { return full_encodes_; }
  uint64_t delta_encodes() const { return delta_encodes_; }
  uint64_t parity_bytes_sent() const { return parity_bytes_sent_; }

 private:
  struct PreparedStep {
    int64_t token = 0;
    uint32_t coordinator = 0;
    // Shared, not copied, by the calls that read it: it lists every region of the node.
    std::shared_ptr<const NodeImage> image;
    // The image as this node reported it (with its node id), serialized: an Encode's copy of it
    // must be the same bytes. Shared, for the comparison to run outside the lock.
    std::shared_ptr<const std::string> reported;
    GroupImages group_images;
    bool encoded = false;
    // A parity receiver (this node rebuilds): no image; the group record of the base step.
    bool receiver = false;
    v1::JournalCluster base_record;
  };
  // Makes `prepared` the step's, under `token` and `coordinator` (a Prepare's); the parity an
  // earlier coordinator's encode opened for the step goes.
  void Open(int64_t step, int64_t token, uint32_t coordinator, PreparedStep prepared);
  // Opens `step` under `leader`'s token with this node's image of it and puts the image in
  // `proposal`, so that the coordinator needs no Prepare of this node. Nothing when this node
  // rebuilds, its capture failed, the step is decided, or it was opened already (by a Prepare or
  // a proposal, under any token).
  void OpenProposed(int64_t step, const LeaderView& leader, v1::ProposeRequest& proposal);
  // The token `step` is open under here; 0 when it is not open.
  int64_t OpenTokenOf(int64_t step) const;
  // Prepare of a node that rebuilds: absent from the step, a parity receiver if it can read the
  // base step's group record from a member and its pool has room for the accumulation.
  v1::PrepareResponse PrepareAbsent(const v1::PrepareRequest& request, absl::Time deadline);
  // The group record of committed step `base` (without parity), from this node or a member that
  // holds it; waits briefly for a member to apply it.
  absl::StatusOr<v1::JournalCluster> BaseRecord(int64_t base, absl::Time deadline);
  // Opens the step's parity units (ParityStore::Begin), then aborts them if the step was decided
  // meanwhile: ABORTED, since no unit would come to end a wait for them.
  absl::Status OpenParity(int64_t step, int64_t token, const std::vector<uint64_t>& image_bytes,
                          const StepChanges* changes, bool accumulate);
  // Once `sending` (this node's own sends) succeeded, waits for the step's parity to be complete,
  // then records the encode (and the group's images) on the prepared step. The parity goes on
  // failure; ABORTED when the step was decided or prepared again meanwhile (`doing` says what this
  // node was doing then).
  absl::Status CompleteEncode(const v1::EncodeRequest& request, absl::Status sending,
                              absl::Time deadline, GroupImages group_images,
                              absl::string_view doing);
  // Encode of a parity receiver (parity_only), `sent` the request's images parsed and checked.
  absl::StatusOr<v1::EncodeResponse> EncodeReceived(const v1::EncodeRequest& request,
                                                    std::vector<v1::NodeImage> sent,
                                                    const std::set<int>& absent);
  // OK when `token` is the one etcd names for `coordinator`'s leadership (waiting briefly for this
  // node to learn of a new leader) and not lower than any this node has seen; raises the highest
  // seen. A token no leader holds is refused: a peer cannot fence the real coordinator out.
  absl::Status Fence(int64_t token, uint32_t coordinator);
  // Makes this node's committed step `base` (absent: none), applying decisions it missed from the
  // log; FAILED_PRECONDITION when it cannot by `deadline`.
  absl::Status CatchUp(std::optional<int64_t> base, absl::Time deadline);
  // Whether `step` is decided (committed at or before this node's committed step, or decided in
  // the log as this node has seen it).
  bool DecidedLocked(int64_t step, const std::optional<int64_t>& committed) const
      ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  absl::Duration CappedWait(uint32_t timeout_ms) const;
  void ProposeLoop();
  bool stopping() const;

  const ClusterContext context_;
  ClusterStore* const store_;
  ParityStore* const parity_;
  Transfer* const transfer_;
  Rebuilder* const rebuilder_;
  DecisionLog* const log_;

  std::atomic<uint64_t> full_encodes_{0};
  std::atomic<uint64_t> delta_encodes_{0};
  std::atomic<uint64_t> parity_bytes_sent_{0};
  std::atomic<uint64_t> degraded_commits_{0};

  absl::Mutex apply_mutex_;  // decisions are applied one at a time
  mutable absl::Mutex mutex_;
  absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::map<int64_t, PreparedStep> open_ ABSL_GUARDED_BY(mutex_);
  // Decisions seen of steps after the committed one: step -> committed.
  std::map<int64_t, bool> decided_ ABSL_GUARDED_BY(mutex_);
  int64_t highest_token_ ABSL_GUARDED_BY(mutex_) = 0;
  uint32_t highest_coordinator_ ABSL_GUARDED_BY(mutex_) = 0;
  std::string last_abort_ ABSL_GUARDED_BY(mutex_);
  std::vector<uint32_t> latest_absent_ ABSL_GUARDED_BY(mutex_);
  // The record the last commit replaced, held by nobody else: memory for the next step's images,
  // with where the committed images differ from its own when they were built on it.
  SpareRecord spare_record_ ABSL_GUARDED_BY(mutex_);
  std::thread proposer_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_PARTICIPANT_H_
