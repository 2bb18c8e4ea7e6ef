// The daemon's part in a cluster, assembled from units under daemon/cluster/ that each do one job:
//   node_table     who holds each node id, where, which are live, who coordinates
//   peer_client    every call to a peer: channels, deadlines, retries, status conversion
//   etcd_session   the client, this node's lease, whether etcd is reachable
//   membership     this node's key in etcd, the config check at join, the node table kept current
//   etcd_control   the decision log (fenced write-once keys), the nodes' durable records (fenced
//                  by their member keys) and the leadership (election)
//   transfer       bytes over the data plane: data units to parity holders, units to rebuilders
//   rebuild        decoding a node's units from its group: rebuild, repair
//   participant    this node's side of every step's commit, acting on decisions etcd holds
//   decision_feed  every decision etcd holds, handed to the participant in order
//   coordinator    elected on etcd, runs each step's commit and writes its decision
//   remote_restore, log_forwarding  elastic restore and upstream logs across nodes
//   durable_view   what the durable tier asks of the job: the nodes' memory, durable steps in etcd
//   peer_service   the Peer gRPC service, translation only
// Units depend on the shared context (context.h) and on each other in that order, never back.
// Node ids 0 .. node_count - 1 form groups of k + m; each node keeps its own data whole and holds
// parity for its group; stripes rotate parity; sparse steps send deltas.
#ifndef MOESNAP_DAEMON_CLUSTER_CLUSTER_H_
#define MOESNAP_DAEMON_CLUSTER_CLUSTER_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/cluster_config.h"
#include "daemon/cluster_store.h"
#include "daemon/durable/job_view.h"
#include "daemon/pool.h"
#include "daemon/upstream_log.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

class Cluster {
 public:
  // Starts the Peer service and the data plane on this node's ports, checks the job's config
  // against every member's in etcd (a difference is an error naming it), registers this node, and
  // rebuilds it if its committed step is behind the latest one etcd holds. Fault injection:
  // `rebuild_hold_steps` (see RebuildOptions::hold_install_steps).
  static absl::StatusOr<std::unique_ptr<Cluster>> Start(
      uint32_t node_id, const ClusterOptions& options, Pool* pool, ClusterStore* store,
      UpstreamLog* log, std::optional<int64_t> rebuild_hold_steps = std::nullopt);
  ~Cluster();

  v1::ClusterStatusResponse Status() const;
  // Waits until this node holds its share of the committed state (a replacement's rebuild at start
  // has finished); why it cannot when the rebuild failed. Every restore, and every answer about
  // what is committed, waits for it.
  absl::Status WaitRestorable(absl::Time deadline) const;
  // Fault injection: as coordinator, SIGKILL this process right after writing the decision of the
  // first step at or after `step` that commits (a coordinator dying before any node acted on its
  // decision). "At or after": an earlier step aborted by a slow start must not skip the fault.
  void set_crash_in_commit_for_testing(int64_t step);
  // Rebuilds node `node_id` (this one, or asks that node to).
  absl::StatusOr<v1::RebuildResponse> Rebuild(uint32_t node_id);
  // Elastic restore into `rank` of what `source_rank` snapshotted on another node: fetched from
  // the node that holds it, or decoded from that node's group when it is lost.
  absl::StatusOr<v1::RestoreResponse> RestoreFrom(uint32_t rank, uint32_t source_rank,
                                                  const std::vector<std::string>& regions);
  // Upstream-log records of a rank that ran on another node, from whichever live node holds them.
  absl::StatusOr<v1::FetchLogResponse> FetchLog(const v1::FetchLogRequest& request);
  // Adds the parity check to a store verification and, with `repair`, rebuilds every corrupt data
  // chunk and parity unit from the group and checks them again.
  absl::StatusOr<v1::VerifyResponse> Verify(std::optional<int64_t> step, bool repair);
  // What the durable tier asks of the job: the nodes' memory, and the steps durable on every node
  // as etcd records them.
  durable::JobView* job_view();

 private:
  struct Units;
  explicit Cluster(std::unique_ptr<Units> units);
  std::unique_ptr<Units> units_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_CLUSTER_CLUSTER_H_
