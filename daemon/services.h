// The gRPC handlers of the Agent (trainers) and Admin (moesnapctl) services: each converts its
// request, calls the store, and converts the result at the edge. No logic lives here.
#ifndef MOESNAP_DAEMON_SERVICES_H_
#define MOESNAP_DAEMON_SERVICES_H_

#include <cstdint>
#include <optional>
#include <string>

#include "daemon/caller_gate.h"
#include "daemon/cluster/cluster.h"
#include "daemon/durable/restore_tiers.h"
#include "daemon/store.h"
#include "daemon/trainer_memory.h"
#include "daemon/unix_server.h"
#include "daemon/upstream_log.h"
#include "proto/moesnap.grpc.pb.h"

namespace moesnap::daemon {

// Facts about this daemon that trainers learn in Hello.
struct NodeFacts {
  uint32_t node_id = 0;
  std::string memory_socket;  // where trainers hand over their host memory
  bool supports_device_memory = false;
};

class AgentService final : public v1::Agent::Service {
 public:
  // `cluster` is null on a single node. LatestCommitted and Restore go through `tiers`. `peers`
  // tells who called Hello.
  AgentService(Store* store, TrainerSessions* sessions, UpstreamLog* log, Cluster* cluster,
               durable::RestoreTiers* tiers, const ConnectionPeers* peers, NodeFacts facts);

  // Calls one rank may have in flight at once (caller_gate.h), well above what a trainer has: the
  // client library starts no threads and makes one call at a time per method called, so a rank
  // has one call in flight per trainer thread calling it. The Python package calls from the
  // training thread only (its one background thread, the elastic keep-alive, talks to the torch
  // store; pipeline logging appends on the training thread): one call. A C++ trainer that waits
  // for commits on a thread of its own while its training thread snapshots and logs: about three.
  static constexpr int kCallsPerRank = 16;

  grpc::Status Hello(grpc::ServerContext*, const v1::HelloRequest*, v1::HelloResponse*) override;
  grpc::Status RegisterRegions(grpc::ServerContext*, const v1::RegisterRegionsRequest*,
                               v1::RegisterRegionsResponse*) override;
  grpc::Status Snapshot(grpc::ServerContext*, const v1::SnapshotRequest*,
                        v1::SnapshotResponse*) override;
  grpc::Status WaitCaptured(grpc::ServerContext*, const v1::WaitRequest*, v1::WaitResponse*) override;
  grpc::Status WaitCommitted(grpc::ServerContext*, const v1::WaitRequest*,
                             v1::WaitResponse*) override;
  grpc::Status Restore(grpc::ServerContext*, const v1::RestoreRequest*,
                       v1::RestoreResponse*) override;
  grpc::Status LatestCommitted(grpc::ServerContext*, const v1::LatestCommittedRequest*,
                               v1::LatestCommittedResponse*) override;
  grpc::Status AppendLog(grpc::ServerContext*, const v1::AppendLogRequest*,
                         v1::AppendLogResponse*) override;
  grpc::Status FetchLog(grpc::ServerContext*, const v1::FetchLogRequest*,
                        v1::FetchLogResponse*) override;

 private:
  // OK once this node holds its share of what was committed (a cluster's replacement may still be
  // rebuilding it); always OK on a single node.
  absl::Status WaitRestorable(absl::Time deadline) const;
  // OK when the call presents a current session bound to `rank` at its Hello; PERMISSION_DENIED
  // naming both ranks when it is bound to another, or when the call presents no current session.
  absl::Status CheckRank(const grpc::ServerContext& context, uint32_t rank) const;
  // A call for `rank`: CheckRank, then one of the rank's slots, held until the call ends
  // (RESOURCE_EXHAUSTED when the rank has kCallsPerRank in flight). Checked first, so that no
  // caller fills another rank's slots. Calls that name no rank (Hello, FetchLog) are bounded by
  // the agent server's thread cap only (agent.max_threads).
  absl::StatusOr<CallerGate::Pass> Admit(const grpc::ServerContext& context, uint32_t rank);

  Store* store_;
  TrainerSessions* sessions_;
  UpstreamLog* log_;
  Cluster* cluster_;
  durable::RestoreTiers* tiers_;
  const ConnectionPeers* peers_;
  NodeFacts facts_;
  CallerGate gate_;
};

class AdminService final : public v1::Admin::Service {
 public:
  // `cluster` is null on a single node.
  AdminService(Store* store, UpstreamLog* log, Cluster* cluster, durable::RestoreTiers* tiers,
               uint32_t node_id, bool pool_locked)
      : store_(store), log_(log), cluster_(cluster), tiers_(tiers), node_id_(node_id),
        pool_locked_(pool_locked) {}

  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*, v1::StatusResponse*) override;
  grpc::Status ListSteps(grpc::ServerContext*, const v1::ListStepsRequest*,
                         v1::ListStepsResponse*) override;
  grpc::Status InspectStep(grpc::ServerContext*, const v1::InspectStepRequest*,
                           v1::InspectStepResponse*) override;
  grpc::Status ListWindows(grpc::ServerContext*, const v1::ListWindowsRequest*,
                           v1::ListWindowsResponse*) override;
  grpc::Status Verify(grpc::ServerContext*, const v1::VerifyRequest*, v1::VerifyResponse*) override;
  grpc::Status DropStep(grpc::ServerContext*, const v1::DropStepRequest*,
                        v1::DropStepResponse*) override;
  grpc::Status DropRank(grpc::ServerContext*, const v1::DropRankRequest*,
                        v1::DropRankResponse*) override;
  grpc::Status ClusterStatus(grpc::ServerContext*, const v1::ClusterStatusRequest*,
                             v1::ClusterStatusResponse*) override;
  grpc::Status Rebuild(grpc::ServerContext*, const v1::RebuildRequest*,
                       v1::RebuildResponse*) override;
  grpc::Status ListDurable(grpc::ServerContext*, const v1::ListDurableRequest*,
                           v1::ListDurableResponse*) override;
  grpc::Status RestoreTier(grpc::ServerContext*, const v1::RestoreTierRequest*,
                           v1::RestoreTierResponse*) override;
  grpc::Status Export(grpc::ServerContext*, const v1::ExportRequest*,
                      grpc::ServerWriter<v1::ExportChunk>*) override;

 private:
  Store* store_;
  UpstreamLog* log_;
  Cluster* cluster_;
  durable::RestoreTiers* tiers_;
  uint32_t node_id_;
  bool pool_locked_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_SERVICES_H_
