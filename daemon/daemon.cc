// Daemon::Start: the start-up sequence, with page-locking by the best backend available.
#include "daemon/daemon.h"

#include <unistd.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/byte_size.h"
#include "common/log.h"
#include "common/memory_handoff_wire.h"
#include "common/shared_memory.h"
#include "daemon/daemon_metrics.h"

namespace moesnap::daemon {

void StopLockOrderTracking() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}
namespace {

HttpResponse StatusAnswer(const absl::Status& status) {
  if (status.ok()) return {200, "text/plain; charset=utf-8", "ok\n"};
  return {503, "text/plain; charset=utf-8", absl::StrCat(status.message(), "\n")};
}

// /metrics for Prometheus; /healthz (alive: the daemon answers on its admin socket) and /readyz
// (alive, and able to serve what it holds: a replacement is ready once it has rebuilt).
std::map<std::string, HttpServer::Handler> OperationsRoutes(HealthMonitor* health) {
  return {
      {"/metrics",
       [] {
         return HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8",
                             metrics::Registry::Default().Exposition()};
       }},
      {"/healthz", [health] { return StatusAnswer(health->Alive()); }},
      {"/readyz", [health] { return StatusAnswer(health->Ready()); }},
  };
}

// The admin socket's server threads (UnixServer::Endpoint::max_threads). Operators run a few
// commands at once, the long ones (export, rebuild, verify, restore-tier) holding a thread for
// their run, and the health probe asks Status every watchdog interval: 64 is room for all of them
// with many to spare, and a cap on a script that loops over moesnapctl.
constexpr int kAdminMaxThreads = 64;

// The default bound on exited trainers' kept memory: half of what the host has.
uint64_t HalfTheHostsMemory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_bytes = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_bytes <= 0) return UINT64_MAX;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_bytes) / 2;
}

}  // namespace


absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  std::unique_ptr<Daemon> daemon(new Daemon());
  absl::StatusOr<AccessPolicy> policy =
      AccessPolicy::FromOptions(options.access, "access.group");
  if (!policy.ok()) return policy.status();
  absl::StatusOr<AccessPolicy> admin_policy =
      AccessPolicy::FromOptions(options.admin_access, "admin.group");
  if (!admin_policy.ok()) return admin_policy.status();
  daemon->sessions_ = std::make_unique<TrainerSessions>(
      options.exited_trainer_memory_retention, TrainerSessions::kMemoryConnectionGrace,
      options.exited_trainer_memory_max_bytes.value_or(HalfTheHostsMemory()));
  daemon->host_backend_ = CreateHostCopyBackend(daemon->sessions_.get());
  absl::StatusOr<std::unique_ptr<CopyBackend>> device = CreateCudaCopyBackend();
  if (device.ok()) {
    daemon->device_backend_ = *std::move(device);
  } else {
    Log(LogLevel::kInfo, "GPU regions disabled: ", device.status().message());
  }

  const bool journal_existed = SharedMemory::Exists(options.pool.name + ".journal");
  absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(options.pool);
  if (!pool.ok()) return pool.status();
  daemon->pool_ = *std::move(pool);
  // A start that fails after creating a fresh pool removes it (and a journal it created), so a
  // failed start leaves /dev/shm as it found it. A re-attached pool holds snapshots: it stays.
  bool started = false;
  absl::Cleanup discard_fresh_pool = [&] {
    if (started || daemon->pool_->reattached()) return;
    daemon.reset();
    (void)SharedMemory::Unlink(options.pool.name + ".data");
    if (!journal_existed) (void)SharedMemory::Unlink(options.pool.name + ".journal");
  };
  Log(LogLevel::kInfo, daemon->pool_->reattached() ? "re-attached" : "created", " pool /dev/shm/",
      daemon->pool_->file_name(), " of ", FormatByteSize(daemon->pool_->capacity()));

  bool locked = false;
  if (options.pool.lock != PoolLockMode::kOff) {
    CopyBackend* pinner = daemon->device_backend_ ? daemon->device_backend_.get()
                                                  : daemon->host_backend_.get();
    absl::Status pinned = pinner->PinHostMemory(daemon->pool_->base(), daemon->pool_->capacity());
    locked = pinned.ok();
    if (!pinned.ok() && options.pool.lock == PoolLockMode::kRequired) {
      return absl::FailedPreconditionError(
          absl::StrCat("pool.lock is 'required' but the pool cannot be page-locked: ",
                       pinned.message()));
    }
    if (!pinned.ok()) {
      Log(LogLevel::kWarning, "the pool is not page-locked (copies run slower and it may be "
          "swapped): ", pinned.message());
    }
  }

  absl::StatusOr<std::unique_ptr<Journal>> journal =
      Journal::OpenOrCreate(options.pool.name, options.pool.journal_bytes);
  if (!journal.ok()) return journal.status();
  daemon->journal_ = *std::move(journal);
  if (const std::optional<int64_t> sequence = options.faults.crash_in_journal_write) {
    daemon->journal_->set_crash_in_write_for_testing(*sequence);
    Log(LogLevel::kWarning, "fault injection: SIGKILL during journal write ", *sequence);
  }

  CaptureOptions capture = options.capture;
  if (options.cluster) {
    capture.parity_share =
        static_cast<double>(options.cluster->parity_units) / options.cluster->data_units;
  }
  absl::StatusOr<std::unique_ptr<Store>> store =
      Store::Open(daemon->pool_.get(), daemon->journal_.get(),
                  {daemon->host_backend_.get(), daemon->device_backend_.get()}, capture,
                  options.cluster ? CommitMode::kCluster : CommitMode::kLocal);
  if (!store.ok()) return store.status();
  daemon->store_ = *std::move(store);

  daemon->upstream_log_ = std::make_unique<UpstreamLog>(
      options.node_id, options.upstream_log,
      [store = daemon->store_.get()](const std::set<uint32_t>& ranks) {
        return store->LogRecoveryPoint(ranks);
      });

  if (options.cluster) {
    absl::StatusOr<std::unique_ptr<Cluster>> cluster =
        Cluster::Start(options.node_id, *options.cluster, daemon->pool_.get(), daemon->store_.get(),
                       daemon->upstream_log_.get(), options.faults.rebuild_hold_steps);
    if (!cluster.ok()) return cluster.status();
    daemon->cluster_ = *std::move(cluster);
    if (const std::optional<int64_t> step = options.faults.crash_in_commit) {
      daemon->cluster_->set_crash_in_commit_for_testing(*step);
      Log(LogLevel::kWarning, "fault injection: as coordinator, SIGKILL right after deciding ",
          "step ", *step, " or the first step committed after it");
    }
  }

  durable::JobView* view = daemon->cluster_ != nullptr
                               ? daemon->cluster_->job_view()
                               : &daemon->single_node_view_;
  if (options.durable.enabled()) {
    durable::StepIdentity identity;
    identity.node_id = options.node_id;
    if (options.cluster) {
      identity.cluster_digest = options.cluster->Digest();
      identity.shape.set_data_units(options.cluster->data_units);
      identity.shape.set_parity_units(options.cluster->parity_units);
      identity.shape.set_stripe_unit_bytes(options.cluster->stripe_unit_bytes);
      identity.cluster_nodes = options.cluster->node_count;
    }
    daemon->drainer_ = std::make_unique<durable::Drainer>(
        options.durable, identity, daemon->store_.get(), view, &daemon->clock_);
    daemon->drainer_->Start();
  }
  daemon->tiers_ = std::make_unique<durable::RestoreTiers>(options.node_id, daemon->store_.get(),
                                                           daemon->drainer_.get(), view);

  const std::string memory_socket = options.agent_socket + memory_handoff::kSocketSuffix;
  daemon->agent_service_ = std::make_unique<AgentService>(
      daemon->store_.get(), daemon->sessions_.get(), daemon->upstream_log_.get(),
      daemon->cluster_.get(), daemon->tiers_.get(), &daemon->connection_peers_,
      NodeFacts{options.node_id, memory_socket, daemon->device_backend_ != nullptr});
  absl::StatusOr<std::vector<FileIdentity>> own_files = IdentifyFiles(
      {"/dev/shm/" + daemon->pool_->file_name(), "/dev/shm/" + options.pool.name + ".journal"});
  if (!own_files.ok()) return own_files.status();
  daemon->memory_handoff_ = std::make_unique<MemoryHandoff>(
      daemon->sessions_.get(), daemon->store_.get(), *std::move(own_files));
  daemon->admin_service_ =
      std::make_unique<AdminService>(daemon->store_.get(), daemon->upstream_log_.get(),
                                     daemon->cluster_.get(), daemon->tiers_.get(), options.node_id,
                                     locked);
  // Every socket and port is bound before any serves: a daemon that cannot have one exits before
  // its admin socket ever answered, so whoever starts it sees the failure, not a daemon that
  // served for a moment. The sockets first: another daemon serving them is the likelier cause.
  absl::StatusOr<std::unique_ptr<UnixServer>> server = UnixServer::Bind(
      {{.path = options.agent_socket,
        .service = daemon->agent_service_.get(),
        .policy = *policy,
        .max_threads = options.agent_max_threads},
       {.path = memory_socket, .handler = daemon->memory_handoff_.get(), .policy = *policy},
       {.path = options.admin_socket,
        .service = daemon->admin_service_.get(),
        .policy = *std::move(admin_policy),
        .max_threads = kAdminMaxThreads}},
      &daemon->connection_peers_);
  if (!server.ok()) return server.status();
  daemon->server_ = *std::move(server);
  if (!options.http.address.empty()) {
    absl::StatusOr<std::unique_ptr<HttpServer>> http = HttpServer::Listen(options.http.address);
    if (!http.ok()) return http.status();
    daemon->http_server_ = *std::move(http);
  }
  if (absl::Status serving = daemon->server_->Serve(); !serving.ok()) return serving;

  daemon->notifier_ = CreateSystemdNotifier();
  daemon->health_ = std::make_unique<HealthMonitor>(
      HealthMonitor::Options{
          .probe = [admin_socket = options.admin_socket] {
            return ProbeAdminSocket(admin_socket, absl::Seconds(5));
          },
          // A replacement node is ready once it holds its share of the committed state.
          .ready =
              [cluster = daemon->cluster_.get()] {
                return cluster != nullptr ? cluster->WaitRestorable(absl::Now()) : absl::OkStatus();
              },
          .on_serving_changed = [server = daemon->server_.get()](bool serving) {
            server->SetServing(serving);
          }},
      daemon->notifier_.get());
  daemon->collectors_ =
      CollectDaemonMetrics(metrics::Registry::Default(), daemon->store_.get(),
                           daemon->sessions_.get(), daemon->upstream_log_.get(),
                           daemon->cluster_.get(), daemon->tiers_.get());
  if (daemon->http_server_) {
    daemon->http_server_->Serve(OperationsRoutes(daemon->health_.get()));
    Log(LogLevel::kInfo, "metrics and health on http://", options.http.address,
        " (/metrics, /healthz, /readyz), port ", daemon->http_server_->port());
  }
  Log(LogLevel::kInfo, "moesnapd node ", options.node_id, " serving trainers on ",
      options.agent_socket, " and operators on ", options.admin_socket);
  // READY=1 once the daemon answered its own probe through the admin socket: then every socket
  // serves, and systemd starts what depends on the daemon.
  if (absl::Status alive = daemon->health_->WaitAlive(absl::Seconds(30)); !alive.ok()) {
    return absl::UnavailableError(
        absl::StrCat("moesnapd started but does not answer on its admin socket: ", alive.message()));
  }
  started = true;
  daemon->health_->AnnounceReady(absl::StrCat("serving node ", options.node_id));
  return daemon;
}

Daemon::~Daemon() {
  if (notifier_) notifier_->Notify("STOPPING=1");
  http_server_.reset();  // no scrapes
  collectors_ = metrics::CollectorHandle();
  health_.reset();          // no probes
  server_.reset();          // no new calls
  memory_handoff_.reset();  // no new memory
  drainer_.reset();         // no drain (a step half written is removed); it surveys the cluster
  cluster_.reset();  // no peer calls, no rounds
  store_.reset();    // finishes queued copies
}

}  // namespace moesnap::daemon
