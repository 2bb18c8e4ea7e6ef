// Cluster: builds the units in dependency order, serves the Peer service, and tears them down in
// reverse once no peer call can reach them.
#include "daemon/cluster/cluster.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/coordinator.h"
#include "daemon/cluster/durable_view.h"
#include "daemon/cluster/local_report.h"
#include "daemon/cluster/log_forwarding.h"
#include "daemon/cluster/membership.h"
#include "daemon/cluster/node_table.h"
#include "daemon/cluster/participant.h"
#include "daemon/cluster/peer_client.h"
#include "daemon/cluster/peer_service.h"
#include "daemon/cluster/rebuild.h"
#include "daemon/cluster/remote_restore.h"
#include "daemon/cluster/transfer.h"
#include "daemon/parity_store.h"

namespace moesnap::daemon {
namespace {

constexpr int kMaxPeerMessageBytes = 64 << 20;

// The Peer service's credentials: where mutual TLS will be switched on (the client side is in
// peer_client.cc).
std::shared_ptr<grpc::ServerCredentials> PeerServerCredentials() {
  return grpc::InsecureServerCredentials();
}

}  // namespace

// Declared in construction order; destroyed in reverse after the server stopped.
struct Cluster::Units {
  ClusterStore* store = nullptr;
  Pool* pool = nullptr;
  std::unique_ptr<const cluster::Topology> topology;
  std::unique_ptr<cluster::NodeTable> nodes;
  std::unique_ptr<cluster::PeerClient> peers;
  cluster::ClusterContext context;
  std::unique_ptr<ParityStore> parity;
  std::unique_ptr<cluster::Transfer> transfer;
  std::unique_ptr<cluster::Membership> membership;
  std::unique_ptr<cluster::Rebuilder> rebuilder;
  std::unique_ptr<cluster::Participant> participant;
  std::unique_ptr<cluster::Coordinator> coordinator;
  std::unique_ptr<cluster::RemoteRestore> remote_restore;
  std::unique_ptr<cluster::LogForwarding> log_forwarding;
  std::unique_ptr<cluster::LocalReport> report;
  std::unique_ptr<cluster::DurableView> durable;
  std::unique_ptr<cluster::PeerService> service;
  std::unique_ptr<grpc::Server> server;

  ~Units() {
    if (server) server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }
};

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Start(uint32_t node_id,
                                                        const ClusterOptions& options, Pool* pool,
                                                        ClusterStore* store, UpstreamLog* log,
                                                        const durable::DurableDirectory* durable) {
  if (options.allow_degraded) {
    return absl::UnimplementedError(
        "cluster.allow_degraded = true is not supported yet: a degraded commit needs parity "
        "deltas against the lost node's last image; set it to false (the default)");
  }
  auto units = std::make_unique<Units>();
  units->store = store;
  units->pool = pool;
  absl::StatusOr<std::unique_ptr<const cluster::Topology>> topology =
      cluster::Topology::Create(node_id, options);
  if (!topology.ok()) return topology.status();
  units->topology = *std::move(topology);
  const absl::Duration interval = cluster::HeartbeatInterval(options);
  units->nodes = std::make_unique<cluster::NodeTable>(
      node_id, options.nodes, absl::Milliseconds(options.heartbeat_timeout_ms));
  units->peers = cluster::NewGrpcPeerClient(units->nodes.get(), {interval});
  units->context = {units->topology.get(), units->nodes.get(), units->peers.get()};
  const cluster::ClusterContext& context = units->context;

  units->parity = std::make_unique<ParityStore>(
      pool, units->topology->codec.get(), &units->topology->layout, units->topology->position,
      absl::Milliseconds(options.commit_timeout_ms));
  if (absl::Status status = units->parity->Recover(store->ClusterRecord()); !status.ok()) {
    return status;
  }
  units->transfer = std::make_unique<cluster::Transfer>(context, store, units->parity.get());
  if (absl::Status status = units->transfer->Start(); !status.ok()) return status;
  units->membership = std::make_unique<cluster::Membership>(context);
  units->rebuilder = std::make_unique<cluster::Rebuilder>(
      context, store, units->parity.get(), units->transfer.get(), pool,
      cluster::RebuildOptions{.settle = interval * 3,
                              .retry_interval = absl::Milliseconds(options.heartbeat_timeout_ms)});
  units->participant = std::make_unique<cluster::Participant>(
      context, store, units->parity.get(), units->transfer.get(), units->rebuilder.get(),
      units->membership.get());
  units->coordinator = std::make_unique<cluster::Coordinator>(context, units->membership.get(),
                                                              units->participant.get());
  units->remote_restore = std::make_unique<cluster::RemoteRestore>(
      context, store, units->transfer.get(), units->rebuilder.get());
  units->log_forwarding = std::make_unique<cluster::LogForwarding>(context, log);
  units->report = std::make_unique<cluster::LocalReport>(
      context, store, units->parity.get(), pool, units->rebuilder.get(), units->participant.get());
  units->durable = std::make_unique<cluster::DurableView>(context, store, units->rebuilder.get(),
                                                         durable);
  units->service = std::make_unique<cluster::PeerService>(cluster::PeerServiceUnits{
      units->membership.get(), units->coordinator.get(), units->participant.get(),
      units->transfer.get(), units->rebuilder.get(), units->remote_restore.get(),
      units->log_forwarding.get(), units->report.get(), units->durable.get()});

  const ClusterNode self = *units->nodes->Address(node_id);
  grpc::ServerBuilder builder;
  int bound_port = 0;
  builder.AddListeningPort(absl::StrCat(self.host, ":", self.control_port), PeerServerCredentials(),
                           &bound_port);
  builder.RegisterService(units->service.get());
  builder.SetMaxReceiveMessageSize(kMaxPeerMessageBytes);
  units->server = builder.BuildAndStart();
  if (units->server == nullptr || bound_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve the Peer service on ", self.host, ":",
                                               self.control_port, " (is the port in use?)"));
  }
  // The config check: every peer that answers now must agree, or this daemon does not join.
  if (absl::Status status = units->membership->Join(); !status.ok()) return status;
  units->membership->Start();
  units->participant->Start();
  units->coordinator->Start();
  units->rebuilder->Start();
  const cluster::Topology& shape = *units->topology;
  Log(LogLevel::kInfo, "node ", node_id, " is position ", shape.position, " of group ", shape.group,
      " [", absl::StrJoin(shape.groups[shape.group], ", "), "], k=", options.data_units,
      " m=", options.parity_units, "; peers on ", self.host, ":", self.control_port,
      ", data plane on port ", self.data_port);
  return std::unique_ptr<Cluster>(new Cluster(std::move(units)));
}

Cluster::Cluster(std::unique_ptr<Units> units) : units_(std::move(units)) {}
Cluster::~Cluster() = default;

v1::ClusterStatusResponse Cluster::Status() const {
  const cluster::Topology& topology = *units_->topology;
  const ClusterOptions& options = topology.options;
  v1::ClusterStatusResponse response;
  response.set_node_id(topology.node_id);
  response.set_full_encodes(units_->participant->full_encodes());
  response.set_delta_encodes(units_->participant->delta_encodes());
  response.set_parity_bytes_sent(units_->participant->parity_bytes_sent());
  response.mutable_shape()->set_data_units(options.data_units);
  response.mutable_shape()->set_parity_units(options.parity_units);
  response.mutable_shape()->set_stripe_unit_bytes(options.stripe_unit_bytes);
  const v1::HeartbeatResponse mine = units_->report->Heartbeat();
  if (mine.has_latest_committed_step()) {
    response.set_latest_committed_step(mine.latest_committed_step());
  }
  response.set_last_abort(units_->participant->last_abort());
  const uint32_t coordinator = units_->membership->Coordinator();
  for (uint32_t id : units_->nodes->Ids()) {
    const std::optional<cluster::NodeView> view = units_->nodes->View(id);
    v1::ClusterNodeStatus* node = response.add_nodes();
    node->set_node_id(id);
    node->set_host(view->address.host);
    node->set_control_port(view->address.control_port);
    node->set_data_port(view->address.data_port);
    const auto [group, position] = *options.GroupOf(id);
    node->set_group(group);
    node->set_position(position);
    node->set_live(view->live);
    node->set_coordinator(id == coordinator);
    const v1::HeartbeatResponse& report = id == topology.node_id ? mine : view->report;
    if (id != topology.node_id) {
      node->set_silent_ms(view->last_seen == absl::InfinitePast()
                              ? -1
                              : absl::ToInt64Milliseconds(absl::Now() - view->last_seen));
    }
    if (report.has_latest_committed_step()) {
      node->set_latest_committed_step(report.latest_committed_step());
    }
    node->set_rebuilding(report.rebuilding());
    *node->mutable_memory() = report.memory();
  }
  return response;
}

absl::Status Cluster::WaitRestorable(absl::Time deadline) const {
  return units_->rebuilder->WaitRestorable(deadline);
}

void Cluster::set_crash_in_commit_for_testing(int64_t step) {
  units_->coordinator->set_crash_in_commit(step);
}

absl::StatusOr<v1::RebuildResponse> Cluster::Rebuild(uint32_t node_id) {
  return units_->rebuilder->RebuildNode(node_id);
}

absl::StatusOr<v1::RestoreResponse> Cluster::RestoreFrom(uint32_t rank, uint32_t source_rank,
                                                         const std::vector<std::string>& regions) {
  return units_->remote_restore->RestoreFrom(rank, source_rank, regions);
}

absl::StatusOr<v1::FetchLogResponse> Cluster::FetchLog(const v1::FetchLogRequest& request) {
  return units_->log_forwarding->FetchRemote(request);
}

absl::StatusOr<v1::VerifyResponse> Cluster::Verify(std::optional<int64_t> step, bool repair) {
  return units_->rebuilder->Verify(step, repair);
}

durable::JobView* Cluster::job_view() { return units_->durable.get(); }

}  // namespace moesnap::daemon
