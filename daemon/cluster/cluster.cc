// Cluster: builds the units in dependency order, serves the Peer service, and tears them down in
// reverse once no peer call can reach them.
#include "daemon/cluster/cluster.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/coordinator.h"
#include "daemon/cluster/decision_feed.h"
#include "daemon/cluster/etcd_control.h"
#include "daemon/cluster/etcd_keys.h"
#include "daemon/cluster/etcd_session.h"
#include "daemon/cluster/durable_view.h"
#include "daemon/cluster/local_report.h"
#include "daemon/cluster/log_forwarding.h"
#include "daemon/cluster/membership.h"
#include "daemon/cluster/node_table.h"
#include "daemon/cluster/parallel.h"
#include "daemon/cluster/participant.h"
#include "daemon/cluster/peer_authenticator.h"
#include "daemon/cluster/peer_checks.h"
#include "daemon/cluster/peer_client.h"
#include "daemon/cluster/peer_service.h"
#include "daemon/cluster/rebuild.h"
#include "daemon/cluster/remote_restore.h"
#include "daemon/cluster/transfer.h"
#include "daemon/parity_store.h"

namespace moesnap::daemon {
namespace {

constexpr int kMaxPeerMessageBytes = 64 << 20;

// Enough for every node to propose at once, a coordinator's calls and a group's rebuild traffic.
int PeerServerThreads(uint32_t node_count) {
  return 64 + 2 * static_cast<int>(std::min<uint32_t>(node_count, 4096));
}

std::string Hostname() {
  char name[256] = {};
  return gethostname(name, sizeof(name) - 1) == 0 ? std::string(name) : std::string();
}

std::string HostPort(const std::string& host, uint16_t port) {
  const bool bracket = host.find(':') != std::string::npos && host[0] != '[';
  return absl::StrCat(bracket ? "[" : "", host, bracket ? "]" : "", ":", port);
}

}  // namespace

// Declared in construction order; destroyed in reverse after the server stopped.
struct Cluster::Units {
  explicit Units(const ClusterOptions& options) : keys(options.job) {}

  cluster::EtcdKeys keys;
  std::unique_ptr<const cluster::Topology> topology;
  std::unique_ptr<cluster::NodeTable> nodes;
  std::unique_ptr<cluster::PeerClient> peers;
  cluster::ClusterContext context;
  std::unique_ptr<cluster::EtcdSession> session;
  std::unique_ptr<cluster::DecisionLog> decisions;
  std::unique_ptr<cluster::DurableRecords> durable_records;
  std::unique_ptr<cluster::Leadership> leadership;
  std::unique_ptr<ParityStore> parity;
  std::unique_ptr<cluster::Transfer> transfer;
  std::unique_ptr<cluster::Membership> membership;
  std::unique_ptr<cluster::Rebuilder> rebuilder;
  std::unique_ptr<cluster::Participant> participant;
  std::unique_ptr<cluster::DecisionFeed> feed;
  std::unique_ptr<cluster::Coordinator> coordinator;
  std::unique_ptr<cluster::RemoteRestore> remote_restore;
  std::unique_ptr<cluster::LogForwarding> log_forwarding;
  std::unique_ptr<cluster::LocalReport> report;
  std::unique_ptr<cluster::DurableView> durable;
  std::unique_ptr<cluster::PeerAuthenticator> authenticator;
  std::unique_ptr<cluster::PeerService> service;
  std::unique_ptr<grpc::Server> server;

  ~Units() {
    if (server) server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }
};

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Start(
    uint32_t node_id, const ClusterOptions& options, Pool* pool, ClusterStore* store,
    UpstreamLog* log, std::optional<int64_t> rebuild_hold_steps) {
  if (absl::Status status = options.Validate(node_id); !status.ok()) return status;
  auto units = std::make_unique<Units>(options);
  absl::StatusOr<std::unique_ptr<const cluster::Topology>> topology =
      cluster::Topology::Create(node_id, options, pool->capacity());
  if (!topology.ok()) return topology.status();
  units->topology = *std::move(topology);
  // The journal's record is this daemon's own writing, but a file: each image in it is checked as
  // a peer's would be before anything sizes, loops over or builds on it (a patched image is then
  // checked at its changes alone), whatever group it lists (a job restarted in another shape
  // encodes whole at its next step, as before). A damaged one is forgotten, not erased: the node
  // rebuilds from its group, and the journal keeps the record until its next write.
  if (const std::shared_ptr<const v1::JournalCluster> journaled = store->ClusterRecord()) {
    for (const v1::NodeImage& image : journaled->group_images()) {
      if (absl::Status status = cluster::CheckNodeImage(image, units->topology->limits);
          !status.ok()) {
        Log(LogLevel::kWarning, "the group record in this node's journal fails the checks a ",
            "peer's must pass (", status.message(), "): it is not used, and the node rebuilds its ",
            "committed step from its group");
        store->ForgetClusterRecord();
        break;
      }
    }
  }
  std::shared_ptr<const PeerTls> tls;
  if (options.tls.enabled()) {
    absl::StatusOr<std::shared_ptr<const PeerTls>> loaded =
        PeerTls::Load(options.NodeTls(node_id), options.job, node_id, options.node_count);
    if (!loaded.ok()) return loaded.status();
    tls = *std::move(loaded);
  } else {
    Log(LogLevel::kWarning, "tls.insecure = true: peers are neither authenticated nor encrypted "
                            "(the Peer service and the data plane listen on loopback only)");
  }
  units->nodes = std::make_unique<cluster::NodeTable>(options.node_count);
  units->peers = cluster::NewGrpcPeerClient(units->nodes.get(), {.tls = tls});
  units->context = {units->topology.get(), units->nodes.get(), units->peers.get(), tls};
  const cluster::ClusterContext& context = units->context;

  absl::StatusOr<std::unique_ptr<cluster::EtcdSession>> session =
      cluster::EtcdSession::Start(options, node_id);
  if (!session.ok()) return session.status();
  units->session = *std::move(session);
  units->decisions = cluster::NewEtcdDecisionLog(units->session.get(), units->keys, node_id);
  units->leadership = cluster::NewEtcdLeadership(units->session.get(), units->keys, node_id);
  units->membership =
      std::make_unique<cluster::Membership>(context, units->session.get(), units->keys);
  // A member with another config refuses this daemon now; etcd out of reach is checked again
  // before this node registers.
  if (absl::Status status = units->membership->CheckConfig(); absl::IsFailedPrecondition(status)) {
    return status;
  } else if (!status.ok()) {
    Log(LogLevel::kWarning, status.message(), "; starting, and joining once etcd answers");
  }

  units->parity = std::make_unique<ParityStore>(
      pool, units->topology->codec.get(), &units->topology->layout, units->topology->position,
      absl::Milliseconds(options.commit_timeout_ms));
  if (absl::Status status = units->parity->Recover(*store->ClusterRecord()); !status.ok()) {
    return status;
  }
  units->transfer = std::make_unique<cluster::Transfer>(context, store, units->parity.get());
  const std::string listen = options.ListenHost();
  absl::StatusOr<uint16_t> data_port = units->transfer->Start(listen, options.data_port);
  if (!data_port.ok()) return data_port.status();
  units->rebuilder = std::make_unique<cluster::Rebuilder>(
      context, store, units->parity.get(), units->transfer.get(), pool, units->decisions.get(),
      cluster::RebuildOptions{.hold_install_steps = rebuild_hold_steps});
  units->participant = std::make_unique<cluster::Participant>(
      context, store, units->parity.get(), units->transfer.get(), units->rebuilder.get(),
      units->decisions.get());
  units->feed = std::make_unique<cluster::DecisionFeed>(
      units->session.get(), units->keys, units->decisions.get(), units->participant.get());
  units->durable_records = cluster::NewEtcdDurableRecords(
      units->session.get(), units->keys, options, node_id, units->membership.get());
  units->coordinator = std::make_unique<cluster::Coordinator>(
      context, units->leadership.get(), units->decisions.get(), store,
      units->durable_records.get());
  units->remote_restore = std::make_unique<cluster::RemoteRestore>(
      context, store, units->transfer.get(), units->rebuilder.get());
  units->log_forwarding = std::make_unique<cluster::LogForwarding>(context, log);
  units->report = std::make_unique<cluster::LocalReport>(
      context, store, units->parity.get(), pool, units->rebuilder.get(), units->participant.get(),
      units->remote_restore.get());
  units->durable = std::make_unique<cluster::DurableView>(context, store, units->rebuilder.get(),
                                                         units->durable_records.get());
  units->authenticator = std::make_unique<cluster::PeerAuthenticator>(tls);
  units->service = std::make_unique<cluster::PeerService>(cluster::PeerServiceUnits{
      units->coordinator.get(), units->participant.get(), units->transfer.get(),
      units->rebuilder.get(), units->remote_restore.get(), units->log_forwarding.get(),
      units->report.get(), units->durable.get(), &units->topology->limits,
      units->authenticator.get()});

  grpc::ServerBuilder builder;
  int control_port = 0;
  builder.AddListeningPort(HostPort(listen, options.control_port),
                           units->authenticator->ServerCredentials(), &control_port);
  builder.RegisterService(units->service.get());
  builder.SetMaxReceiveMessageSize(kMaxPeerMessageBytes);
  // Calls park a thread while they wait (Prepare, Encode: up to the commit timeout), so threads are
  // capped: a call beyond the cap is refused with RESOURCE_EXHAUSTED, never queued without bound.
  grpc::ResourceQuota quota("moesnap-peer");
  quota.SetMaxThreads(PeerServerThreads(options.node_count));
  builder.SetResourceQuota(quota);
  units->server = builder.BuildAndStart();
  if (units->server == nullptr || control_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve the Peer service on ",
                                               HostPort(listen, options.control_port),
                                               " (is the port in use?)"));
  }

  v1::MemberRecord self;
  self.set_node_id(node_id);
  self.set_host(options.advertise_host);
  self.set_control_port(static_cast<uint32_t>(control_port));
  self.set_data_port(*data_port);
  self.set_hostname(Hostname());
  self.set_config_digest(options.Digest());
  *self.mutable_shape() = cluster::ShapeOf(options);
  units->membership->Start(self);
  units->feed->Start();
  units->rebuilder->Start();
  units->participant->Start();
  units->coordinator->Start();
  const cluster::Topology& shape = *units->topology;
  Log(LogLevel::kInfo, "node ", node_id, " of job '", options.job, "' is position ", shape.position,
      " of group ", shape.group, " [", absl::StrJoin(shape.groups[shape.group], ", "),
      "], k=", options.data_units, " m=", options.parity_units, "; advertised as ",
      HostPort(options.advertise_host, static_cast<uint16_t>(control_port)), " (data plane port ",
      *data_port, "), etcd at ", absl::StrJoin(options.etcd_endpoints, ", "),
      tls ? "; peers authenticated with mutual TLS as " + PeerUri(tls->self()) : "");
  return std::unique_ptr<Cluster>(new Cluster(std::move(units)));
}

Cluster::Cluster(std::unique_ptr<Units> units) : units_(std::move(units)) {}
Cluster::~Cluster() = default;

v1::ClusterStatusResponse Cluster::Status() const {
  const cluster::Topology& topology = *units_->topology;
  const ClusterOptions& options = topology.options;
  v1::ClusterStatusResponse response;
  response.set_node_id(topology.node_id);
  response.set_job(options.job);
  for (const std::string& endpoint : options.etcd_endpoints) response.add_etcd_endpoints(endpoint);
  if (std::optional<absl::Time> since = units_->session->unreachable_since()) {
    response.set_etcd_unreachable_since_unix_ms(absl::ToUnixMillis(*since));
  }
  response.set_full_encodes(units_->participant->full_encodes());
  response.set_delta_encodes(units_->participant->delta_encodes());
  response.set_parity_bytes_sent(units_->participant->parity_bytes_sent());
  response.mutable_shape()->set_data_units(options.data_units);
  response.mutable_shape()->set_parity_units(options.parity_units);
  response.mutable_shape()->set_stripe_unit_bytes(options.stripe_unit_bytes);
  response.set_last_abort(units_->participant->last_abort());
  response.set_degraded_commits(units_->participant->degraded_commits());
  for (uint32_t id : units_->participant->latest_absent()) response.add_absent_nodes(id);
  response.set_rebuild_error(std::string(units_->rebuilder->last_failure().message()));
  response.set_peer_calls(units_->peers->calls());
  response.set_etcd_writes(units_->session->writes());
  response.set_etcd_keep_alives(units_->session->keep_alives());
  response.set_peer_tls(units_->context.tls != nullptr);
  const PeerRefusalSummary refusals = PeerRefusals();
  response.set_peer_refusals(refusals.total);
  response.set_last_peer_refusal(refusals.last);
  const auto [closed, last_closed] = units_->transfer->ConnectionsClosed();
  response.set_data_connections_closed(closed);
  response.set_last_data_connection_closed(last_closed);
  const std::optional<cluster::LeaderView> leader = units_->nodes->Leader();
  if (leader) response.set_coordinator_token(leader->token);
  const v1::NodeReport mine = units_->report->Describe();
  if (mine.has_latest_committed_step()) {
    response.set_latest_committed_step(mine.latest_committed_step());
  }
  // What every other live node says of itself, asked now.
  const std::vector<uint32_t> ids = units_->nodes->Ids();
  std::vector<std::optional<v1::NodeReport>> reports(ids.size());
  cluster::InParallel(ids, [&](uint32_t id) -> absl::Status {
    if (id == topology.node_id) {
      reports[id] = mine;
    } else if (units_->nodes->Live(id)) {
      absl::StatusOr<v1::NodeReport> report = units_->peers->Describe(id);
      if (report.ok()) reports[id] = *std::move(report);
    }
    return absl::OkStatus();
  });
  for (uint32_t id : ids) {
    const cluster::NodeView view = units_->nodes->View(id);
    v1::ClusterNodeStatus* node = response.add_nodes();
    node->set_node_id(id);
    node->set_host(view.address.host);
    node->set_control_port(view.address.control_port);
    node->set_data_port(view.address.data_port);
    node->set_hostname(view.hostname);
    node->set_incarnation(view.incarnation);
    const auto [group, position] = *options.GroupOf(id);
    node->set_group(group);
    node->set_position(position);
    node->set_live(view.live);
    node->set_coordinator(leader && leader->node_id == id);
    if (const std::optional<v1::NodeReport>& report = reports[id]) {
      node->set_answered(true);
      if (report->has_latest_committed_step()) {
        node->set_latest_committed_step(report->latest_committed_step());
      }
      node->set_rebuilding(report->rebuilding());
      node->set_received_steps(report->received_steps());
      *node->mutable_memory() = report->memory();
    }
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
