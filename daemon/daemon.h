// moesnapd assembled: pool, journal, copy backends, store, cluster, services and sockets, then the
// operations side (health, metrics over HTTP, systemd notification), built from the configuration
// in dependency order and torn down in reverse.
#ifndef MOESNAP_DAEMON_DAEMON_H_
#define MOESNAP_DAEMON_DAEMON_H_

#include <memory>

#include "absl/status/statusor.h"
#include "daemon/cluster/cluster.h"
#include "daemon/config.h"
#include "common/metrics.h"
#include "daemon/copy_backend.h"
#include "daemon/health.h"
#include "daemon/http_server.h"
#include "daemon/durable/clock.h"
#include "daemon/durable/drainer.h"
#include "daemon/durable/job_view.h"
#include "daemon/durable/restore_tiers.h"
#include "daemon/journal.h"
#include "daemon/memory_handoff.h"
#include "daemon/pool.h"
#include "daemon/services.h"
#include "daemon/store.h"
#include "daemon/trainer_memory.h"
#include "daemon/unix_server.h"
#include "daemon/upstream_log.h"

namespace moesnap::daemon {

// For a process that runs daemons in production (moesnapd, the benchmarks), before any thread
// starts: stops absl's Mutex from tracking the order of every lock acquisition. An absl built
// without NDEBUG (Debian's) does so by default, under one process-wide lock, for the daemon's
// locks and gRPC's alike: in a cluster benchmark, a third as many samples as the daemon's own code.
// Tests keep the tracking, and ThreadSanitizer checks lock order in CI.
void StopLockOrderTracking();

class Daemon {
 public:
  // Opens or re-attaches the pool and journal, recovers the store, and starts serving; then tells
  // systemd READY=1 (when it started the daemon).
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  ~Daemon();  // STOPPING=1, stops serving, finishes queued copies; the pool and journal stay

  // The HTTP endpoint's port (0 when http.address is empty).
  uint16_t http_port() const { return http_server_ ? http_server_->port() : 0; }

 private:
  Daemon() = default;

  std::unique_ptr<TrainerSessions> sessions_;  // before the host backend, which reads it
  ConnectionPeers connection_peers_;            // filled by server_, read by agent_service_
  std::unique_ptr<CopyBackend> host_backend_;
  std::unique_ptr<CopyBackend> device_backend_;
  std::unique_ptr<Pool> pool_;
  std::unique_ptr<Journal> journal_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<UpstreamLog> upstream_log_;
  std::unique_ptr<Cluster> cluster_;
  durable::SystemClock clock_;
  durable::SingleNodeView single_node_view_;
  std::unique_ptr<durable::Drainer> drainer_;
  std::unique_ptr<durable::RestoreTiers> tiers_;
  std::unique_ptr<AgentService> agent_service_;
  std::unique_ptr<AdminService> admin_service_;
  std::unique_ptr<MemoryHandoff> memory_handoff_;
  std::unique_ptr<UnixServer> server_;
  std::unique_ptr<ServiceNotifier> notifier_;
  std::unique_ptr<HealthMonitor> health_;
  metrics::CollectorHandle collectors_;
  std::unique_ptr<HttpServer> http_server_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_DAEMON_H_
