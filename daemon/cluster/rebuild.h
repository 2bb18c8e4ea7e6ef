// Rebuild and repair: decoding a node's units of the committed step from k units per stripe held
// by its group's other nodes, fetched over the data plane.
//   - A node whose journal is behind its group's (a replacement with fresh memory, or a node that
//     died during a commit) rebuilds its data and parity at start, and on an operator's request.
//   - Repair rebuilds the chunks and parity units a scrub found corrupt.
//   - Remote restore decodes the units of a lost node that cover the regions it wants.
// Restore waits while this node is rebuilding; more than m nodes of a group lost makes it fail with
// the group, the lost nodes and the step that can no longer be recovered.
#ifndef MOESNAP_DAEMON_CLUSTER_REBUILD_H_
#define MOESNAP_DAEMON_CLUSTER_REBUILD_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/cluster/context.h"
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
  // Receives each decoded data unit (its index in the node's image, its bytes).
  std::function<void(uint64_t unit, const uint8_t* bytes, uint64_t length)> write_data;
  std::map<uint64_t, ParityUnit>* parity = nullptr;  // decoded parity goes here (null: none)
};

struct RebuildOptions {
  // How long to let membership find the live peers before the rebuild at start.
  absl::Duration settle = absl::Seconds(1);
  // Between attempts of the rebuild at start.
  absl::Duration retry_interval = absl::Seconds(2);
};

// Thread-safe.
class Rebuilder {
 public:
  Rebuilder(const ClusterContext& context, ClusterStore* store, ParityStore* parity,
            Transfer* transfer, Pool* pool, const RebuildOptions& options);
  ~Rebuilder();  // stops a rebuild at start that has not begun

  // Starts the rebuild at start, which finds whether this node is behind its group.
  void Start();

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
  // Which positions of `group` hold `step` whole now (live, not rebuilding, committed it); the
  // position `excluded` never counts.
  std::vector<bool> HoldersOf(int group, int64_t step, int excluded);

  // Waits until this node holds its share of the committed state; why it cannot when the rebuild
  // failed.
  absl::Status WaitRestorable(absl::Time deadline) const;
  // True while this node does not hold its data of the latest committed step (rebuilding, or a
  // rebuild failed).
  bool behind() const;
  // True while the rebuild at start (or one asked for) runs.
  bool rebuilding() const;
  // The store's committed state was replaced by a step loaded from the durable tier: a rebuild
  // that failed no longer holds this node back (it takes part in the steps that follow).
  void StateReplaced();
  // This node's record of the committed step (without pool offsets) for a group member.
  v1::GroupStateResponse GroupState() const;

 private:
  absl::StatusOr<v1::RebuildResponse> RebuildSelf(bool force);
  absl::Status DecodeLocked(const DecodeTarget& target, const std::vector<uint64_t>& stripes,
                            v1::RebuildResponse* stats) ABSL_EXCLUSIVE_LOCKS_REQUIRED(decode_mutex_);
  void RebuildAtStart();
  // False when stopping.
  bool SleepUnlessStopping(absl::Duration duration);

  const ClusterContext context_;
  ClusterStore* const store_;
  ParityStore* const parity_;
  Transfer* const transfer_;
  Pool* const pool_;
  const RebuildOptions options_;

  absl::Mutex decode_mutex_;  // one rebuild, repair or remote decode at a time

  mutable absl::Mutex mutex_;
  mutable absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  bool rebuilding_ ABSL_GUARDED_BY(mutex_) = true;  // until the start-up check says otherwise
  absl::Status error_ ABSL_GUARDED_BY(mutex_);
  std::thread at_start_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_REBUILD_H_
