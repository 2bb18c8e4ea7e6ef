// The daemon's part in a cluster: membership (heartbeats, liveness, the coordinator), the per-step
// two-phase commit across every node, parity for its group over the data plane, and rebuild.
//
// Commit of step S, run by the coordinator (the lowest live node id):
//   Prepare  every node waits until its trainers captured S and reports its image (NodeImage).
//   Encode   every node gets its group's images, opens its parity units of S, sends each of its
//            data units to the stripe's m parity holders (kParityDelta frames), and answers once
//            every unit it holds has received all its data: "data captured + parity stored".
//   Commit   every node journals S (its versions, its group's images, its parity) and frees the
//            previous step; or Abort, and S is forgotten everywhere with the previous step intact.
// A node commits only after every node has encoded, so if the coordinator dies the next lowest
// live node finishes the open step: commit if any node committed it or every live node encoded it,
// abort otherwise (then no node can have committed it).
//
// Rebuild: a node whose journal is behind its group's (a replacement with fresh memory, or a node
// that died during a commit) fetches k units per stripe from the group's survivors over the data
// plane, decodes its data units and parity units, checks every chunk CRC against the group's record,
// and installs them; Restore waits for it. More than m nodes of a group lost makes Restore fail
// with the group, the lost nodes and the step that can no longer be recovered.
//
// Credentials: PeerChannelCredentials and PeerServerCredentials are the single place where mutual
// TLS for the Peer service will be switched on; the data plane has its own (data_plane.h).
#ifndef MOESNAP_DAEMON_CLUSTER_H_
#define MOESNAP_DAEMON_CLUSTER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/cluster_config.h"
#include "daemon/durable/durable_directory.h"
#include "daemon/durable/job_view.h"
#include "daemon/pool.h"
#include "daemon/store.h"
#include "daemon/upstream_log.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

// As the durable tier's JobView: this node's memory is ready once its start-up rebuild has
// ended, and the peers report their durable steps and memory through the Peer service.
class Cluster final : public durable::JobView {
 public:
  // Starts the Peer service and the data plane on this node's ports, checks the cluster config with
  // every peer that answers (a difference is an error naming it), and starts a rebuild if this
  // node's committed step is behind its group's. `durable` (null: no durable tier) is where this
  // node's durable steps are, for the peers that ask.
  static absl::StatusOr<std::unique_ptr<Cluster>> Start(uint32_t node_id,
                                                        const ClusterOptions& options, Pool* pool,
                                                        Store* store, UpstreamLog* log,
                                                        const durable::DurableDirectory* durable);
  ~Cluster() override;

  // durable::JobView
  absl::Status WaitMemory(absl::Time deadline) override;
  durable::PeerSurvey SurveyPeers(absl::Time deadline) override;

  v1::ClusterStatusResponse Status() const;
  // Fault injection: as coordinator of the first step at or after `step` that reaches its commit,
  // commit it on the first half of the nodes and SIGKILL this process (a coordinator dying between
  // commits). "At or after": an earlier step aborted by a slow start must not skip the fault.
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

 private:
  class Impl;
  explicit Cluster(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_CLUSTER_H_
