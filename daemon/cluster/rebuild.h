// Rebuild and repair: decoding a node's units of the committed step from k units per stripe held
// by its group's other nodes. Each stripe is decoded by a helper, one of those k nodes (they take
// turns), which fetches the other k - 1 units over the data plane and sends the decoded unit on:
// the decoding node receives one unit per stripe.
//   - A node whose committed step is behind the latest one etcd holds (a replacement with fresh
//     memory, a node that died or was cut off during a commit, a node that missed a commit) rebuilds
//     its data and parity: checked at start, and whenever it finds itself behind. A failed rebuild is
//     reported and tried again (backing off) until it succeeds.
//   - An operator's rebuild of a node that holds its data already rebuilds it anyway; if that fails
//     the node keeps serving what it holds.
//   - Repair rebuilds the chunks and parity units a scrub found corrupt.
//   - Remote restore decodes the units of a lost node that cover the regions it wants.
//   - While it rebuilds and steps commit without it (cluster.allow_degraded), the participant
//     receives each step's parity change (ParityStore accumulations); once a rebuilt step is
//     installed, the rebuilder folds them in step by step (its data, absent throughout, is
//     unchanged), so it ends at the latest committed step instead of behind it. A committed step
//     it did not receive means another rebuild, from the then latest step.
// Restore waits for the first check, and is refused only while this node does not hold the latest
// committed step; more than m nodes of a group lost makes it fail with the group, the lost nodes and
// the step that can no longer be recovered.
#ifndef MOESNAP_DAEMON_CLUSTER_REBUILD_H_
#define MOESNAP_DAEMON_CLUSTER_REBUILD_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/control.h"
#include "daemon/cluster/decode_helper.h"
#include "daemon/cluster/transfer.h"
#include "daemon/cluster_store.h"
#include "daemon/parity_store.h"
#include "daemon/pool.h"

namespace moesnap::daemon::cluster {

// What a decode produces and where it puts it: the units of node `position` of group `group`.
struct DecodeTarget {
  v1::JournalCluster record;  // the group's record of the step decoded
  int group = 0;
  int position = 0;
  // Receives each decoded data unit (its index in the node's image, its bytes); called from
  // several threads at once, each with units of its own.
  std::function<void(uint64_t unit, const uint8_t* bytes, uint64_t length)> write_data;
  std::map<uint64_t, ParityUnit>* parity = nullptr;  // decoded parity goes here (null: none)
  // A rebuild's new image (the one write_data writes to) and its parity, which nothing reads before
  // the decode ends: units are received straight into them (a data unit where it lies in one piece
  // of the image, a parity unit into its extent) instead of copied there after. Data received so
  // is not checked frame by frame: the caller checks the whole image against its chunk CRCs after
  // the decode (NodeImage::CorruptChunks). Null: every unit lands in scratch, checked, then copied.
  const NodeImage* fresh_image = nullptr;
  // Which positions of the group hold the step whole, asked just before; empty: the decode asks.
  std::vector<bool> holders = {};
};

struct RebuildOptions {
  // Between a failed attempt and the next; doubled after each failure, up to max_retry_interval.
  absl::Duration retry_interval = absl::Milliseconds(200);
  absl::Duration max_retry_interval = absl::Seconds(30);
  // Fault injection (tests): a rebuild that has decoded step S waits, before installing it, until
  // the decision log holds a committed step at or after S + this (a rebuild slower than the steps
  // committing meanwhile).
  std::optional<int64_t> hold_install_steps;
  // What a helper decodes in at once: a request to it carries stripes of at most this many bytes,
  // k + 1 units a stripe (HelperStripeBytes; one stripe at least), and a helper refuses more. The rebuilding node holds
  // one unit a stripe of each helper's request in flight, of the units that do not land in place
  // (DecodeTarget::fresh_image). The same on every node of a cluster.
  uint64_t helper_request_bytes = uint64_t{64} << 20;
};

// Thread-safe.
class Rebuilder {
 public:
  Rebuilder(const ClusterContext& context, ClusterStore* store, ParityStore* parity,
            Transfer* transfer, Pool* pool, DecisionLog* log, const RebuildOptions& options);
  ~Rebuilder();  // stops after the attempt in progress

  // Starts checking whether this node is behind, and rebuilding while it is.
  void Start();
  // The group committed `step` and this node could not take it: rebuild, or, when it received the
  // step's parity change (kept in the parity store), catch up through it once it holds its base.
  void NoteBehind(int64_t step);
  // Committed steps this node caught up with from the parity it received while it rebuilt.
  uint64_t caught_up_steps() const { return caught_up_steps_; }
  // Bytes this node's rebuilds received straight into their new image and parity, in all
  // (DecodeTarget::fresh_image).
  uint64_t in_place_bytes() const { return in_place_bytes_; }

  // Rebuilds node `node_id` (this one, or asks that node to).
  absl::StatusOr<v1::RebuildResponse> RebuildNode(uint32_t node_id);
  // Rebuilds this node's data and parity of the group's latest committed step, even if it holds it.
  absl::StatusOr<v1::RebuildResponse> RebuildHere();
  // Adds the parity check to a store verification and, with `repair`, rebuilds every corrupt data
  // chunk and parity unit from the group and checks them again.
  absl::StatusOr<v1::VerifyResponse> Verify(std::optional<int64_t> step, bool repair);
  // Decodes `target`'s units of `stripes` from k units of the group's other nodes; one decode at a
  // time on this node.
  absl::Status Decode(const DecodeTarget& target, const std::vector<uint64_t>& stripes,
                      v1::RebuildResponse* stats);
  // As a helper of a rebuilding node (DecodeUnits): see DecodeHelper::DecodeFor. One request at a
  // time on this node, apart from its own decodes.
  absl::StatusOr<v1::DecodeUnitsResponse> DecodeFor(
      const v1::DecodeUnitsRequest& request, const std::function<bool()>& cancelled);

  // Waits for the first check; then OK while this node holds the latest committed step, or why it
  // does not (still rebuilding, or the last attempt's failure).
  absl::Status WaitRestorable(absl::Time deadline) const;
  // True until the first check, and while this node does not hold its data of the latest committed
  // step.
  bool behind() const;
  // Waits up to `deadline` for the first check; then behind().
  bool BehindAfterCheck(absl::Time deadline) const;
  // Why the last rebuild failed (OK if it did not).
  absl::Status last_failure() const;
  // True until the first check ends, and while a rebuild that has not failed yet runs.
  bool rebuilding() const;
  // The store's committed state was replaced by a step loaded from the durable tier (the job went
  // back to it): the steps committed so far, as etcd holds them, no longer need rebuilding, and
  // this node takes part in the steps that follow (encoded whole, as it holds no committed step).
  void StateReplaced();
  // The latest step committed before the state was replaced (absent: it was not).
  std::optional<int64_t> replaced_through() const;
  // This node's record of the committed step (without pool offsets) for a group member.
  v1::GroupStateResponse GroupState() const;

 private:
  // Rebuilds this node's units of the group's latest committed step, which must be `target` when
  // given (UNAVAILABLE while no member holds it yet). Without `force`, nothing happens when this
  // node holds that step already.
  absl::StatusOr<v1::RebuildResponse> RebuildSelf(bool force, std::optional<int64_t> target);
  // What each member of `group` says of its state now, asked all at once; the position
  // `excluded` is not asked (NOT_FOUND).
  std::vector<absl::StatusOr<v1::GroupStateResponse>> GroupStates(int group, int excluded);
  // Which positions hold `step` whole by `states` (answered, not rebuilding, committed it).
  static std::vector<bool> HoldersIn(
      const std::vector<absl::StatusOr<v1::GroupStateResponse>>& states, int64_t step);
  absl::Status DecodeLocked(const DecodeTarget& target, const std::vector<uint64_t>& stripes,
                            v1::RebuildResponse* stats) ABSL_EXCLUSIVE_LOCKS_REQUIRED(decode_mutex_);
  void Run();
  // Makes each kept accumulation whose base is the committed step the committed parity, with the
  // step's group record (this node's data is unchanged in it); returns how many.
  int CatchUpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(decode_mutex_);
  // See RebuildOptions::hold_install_steps.
  void HoldInstall(int64_t until);
  bool ReplacedLocked(int64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const ClusterContext context_;
  ClusterStore* const store_;
  ParityStore* const parity_;
  Transfer* const transfer_;
  Pool* const pool_;
  DecisionLog* const log_;
  const RebuildOptions options_;
  std::atomic<uint64_t> caught_up_steps_{0};
  std::atomic<uint64_t> in_place_bytes_{0};

  DecodeHelper helper_;       // decodes for other nodes
  absl::Mutex decode_mutex_;  // one rebuild, repair or remote decode at a time

  mutable absl::Mutex mutex_;
  mutable absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  bool checked_ ABSL_GUARDED_BY(mutex_) = false;  // the first check ended
  bool behind_ ABSL_GUARDED_BY(mutex_) = true;    // does not hold the latest committed step
  bool wanted_ ABSL_GUARDED_BY(mutex_) = true;    // a check is due
  std::optional<int64_t> target_ ABSL_GUARDED_BY(mutex_);  // the step being rebuilt
  absl::Status failure_ ABSL_GUARDED_BY(mutex_);  // of the last attempt
  std::optional<int64_t> replaced_through_ ABSL_GUARDED_BY(mutex_);  // see StateReplaced
  std::thread thread_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_REBUILD_H_
