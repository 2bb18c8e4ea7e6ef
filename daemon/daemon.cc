// Daemon::Start: the start-up sequence, with page-locking by the best backend available.
#include "daemon/daemon.h"

#include <cstdlib>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/byte_size.h"
#include "common/log.h"
#include "common/memory_handoff_wire.h"
#include "common/shared_memory.h"

namespace moesnap::daemon {

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  std::unique_ptr<Daemon> daemon(new Daemon());
  absl::StatusOr<AccessPolicy> policy = AccessPolicy::FromOptions(options.access);
  if (!policy.ok()) return policy.status();

  daemon->sessions_ = std::make_unique<TrainerSessions>();
  daemon->host_backend_ = CreateHostCopyBackend(daemon->sessions_.get());
  absl::StatusOr<std::unique_ptr<CopyBackend>> device = CreateCudaCopyBackend();
  if (device.ok()) {
    daemon->device_backend_ = *std::move(device);
  } else {
    Log(LogLevel::kInfo, "GPU regions disabled: ", device.status().message());
  }

  const bool journal_existed = SharedMemory::Exists(options.pool.name + ".journal");
  absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(options.pool, policy->group());
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
      Journal::OpenOrCreate(options.pool.name, options.pool.journal_bytes, policy->group());
  if (!journal.ok()) return journal.status();
  daemon->journal_ = *std::move(journal);
  if (const char* crash = std::getenv("MOESNAP_CRASH_IN_JOURNAL_WRITE")) {
    int64_t sequence = 0;
    if (absl::SimpleAtoi(crash, &sequence)) {
      daemon->journal_->set_crash_in_write_for_testing(sequence);
      Log(LogLevel::kWarning, "fault injection: SIGKILL during journal write ", sequence);
    }
  }

  absl::StatusOr<std::unique_ptr<Store>> store =
      Store::Open(daemon->pool_.get(), daemon->journal_.get(),
                  {daemon->host_backend_.get(), daemon->device_backend_.get()}, options.capture,
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
                       daemon->upstream_log_.get());
    if (!cluster.ok()) return cluster.status();
    daemon->cluster_ = *std::move(cluster);
    if (const char* crash = std::getenv("MOESNAP_CRASH_IN_COMMIT")) {
      int64_t step = 0;
      if (absl::SimpleAtoi(crash, &step)) {
        daemon->cluster_->set_crash_in_commit_for_testing(step);
        Log(LogLevel::kWarning, "fault injection: as coordinator, SIGKILL right after deciding ",
            "step ", step, " or the first step committed after it");
      }
    }
  }

  const std::string memory_socket = options.agent_socket + memory_handoff::kSocketSuffix;
  daemon->agent_service_ = std::make_unique<AgentService>(
      daemon->store_.get(), daemon->sessions_.get(), daemon->upstream_log_.get(),
      daemon->cluster_.get(),
      NodeFacts{options.node_id, memory_socket, daemon->device_backend_ != nullptr});
  daemon->memory_handoff_ =
      std::make_unique<MemoryHandoff>(daemon->sessions_.get(), daemon->store_.get());
  daemon->admin_service_ =
      std::make_unique<AdminService>(daemon->store_.get(), daemon->upstream_log_.get(),
                                     daemon->cluster_.get(), options.node_id, locked);
  absl::StatusOr<std::unique_ptr<UnixServer>> server = UnixServer::Start(
      {{.path = options.agent_socket, .service = daemon->agent_service_.get()},
       {.path = memory_socket, .handler = daemon->memory_handoff_.get()},
       {.path = options.admin_socket, .service = daemon->admin_service_.get()}},
      *std::move(policy));
  if (!server.ok()) return server.status();
  daemon->server_ = *std::move(server);
  Log(LogLevel::kInfo, "moesnapd node ", options.node_id, " serving trainers on ",
      options.agent_socket, " and operators on ", options.admin_socket);
  started = true;
  return daemon;
}

Daemon::~Daemon() {
  server_.reset();          // no new calls
  memory_handoff_.reset();  // no new memory
  cluster_.reset();  // no peer calls, no rounds
  store_.reset();    // finishes queued copies
}

}  // namespace moesnap::daemon
