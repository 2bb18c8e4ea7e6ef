// CollectDaemonMetrics: one collector that turns status responses into samples.
#include "daemon/daemon_metrics.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/progress.h"

namespace moesnap::daemon {
namespace {

void CollectTrainerMemory(const TrainerSessions& sessions, metrics::Collection& out) {
  const TrainerSessions::Shared shared = sessions.shared();
  const std::string help =
      "Shared memory trainers handed over, mapped by this daemon, by the pages it is made of";
  out.AddGauge("moesnap_trainer_memory_bytes", help, shared.huge_page_bytes, {{"pages", "huge"}});
  out.AddGauge("moesnap_trainer_memory_bytes", help, shared.ordinary_bytes,
               {{"pages", "ordinary"}});
  const TrainerSessions::Retention retention = sessions.retention();
  out.AddGauge("moesnap_exited_trainer_memory_bytes",
               "Shared memory of exited trainers kept for their ranks' next processes",
               retention.kept_bytes);
  out.AddGauge("moesnap_exited_trainer_memory_files",
               "Shared-memory files of exited trainers kept for their ranks' next processes",
               retention.kept_files);
  out.AddCounter("moesnap_exited_trainer_memory_adopted_bytes_total",
                 "Bytes of kept shared memory a restarted trainer took instead of allocating",
                 retention.adopted_bytes_total);
  out.AddCounter("moesnap_exited_trainer_memory_bound_released_bytes_total",
                 "Bytes of exited trainers' memory released before their time to stay within "
                 "agent.exited_trainer_memory_max_bytes",
                 retention.bound_released_bytes_total);
}

void CollectStore(Store& store, metrics::Collection& out) {
  const v1::StatusResponse status = store.Status();
  out.AddGauge("moesnap_pool_capacity_bytes", "Capacity of the snapshot pool", status.pool_bytes());
  out.AddGauge("moesnap_pool_used_bytes", "Pool bytes held by committed versions",
               status.pool_used_bytes());
  out.AddGauge("moesnap_pool_in_flight_bytes", "Pool bytes held by versions being captured",
               status.pool_in_flight_bytes());
  out.AddGauge("moesnap_pool_free_bytes", "Pool bytes neither committed nor in flight",
               static_cast<double>(status.pool_bytes()) - status.pool_used_bytes() -
                   status.pool_in_flight_bytes());
  out.AddGauge("moesnap_ranks", "Trainer ranks with registered regions", status.ranks());
  out.AddGauge("moesnap_journal_sequence", "Sequence number of the journal's newest state",
               status.journal_sequence());
  out.AddGauge("moesnap_uptime_seconds", "Seconds since this daemon started", status.uptime_seconds());
}

void CollectLog(UpstreamLog& log, metrics::Collection& out) {
  v1::ListWindowsResponse described;
  log.Describe(&described);
  out.AddGauge("moesnap_upstream_log_bytes", "Bytes the upstream log holds", described.log_bytes());
  out.AddGauge("moesnap_upstream_log_budget_bytes", "Bytes the upstream log may hold",
               described.log_budget_bytes());
  out.AddGauge("moesnap_upstream_log_records", "Records the upstream log holds",
               described.log_records());
}

void CollectCluster(Cluster& cluster, metrics::Collection& out) {
  const v1::ClusterStatusResponse status = cluster.Status();
  for (const v1::ClusterNodeStatus& node : status.nodes()) {
    if (node.node_id() == status.node_id()) {
      out.AddGauge("moesnap_cluster_coordinator", "1 when this node coordinates the commits",
                   node.coordinator() ? 1 : 0);
      out.AddGauge("moesnap_rebuilding", "1 while this node rebuilds its data and parity",
                   node.rebuilding() ? 1 : 0);
      out.AddGauge("moesnap_rebuild_received_steps",
                   "Committed steps whose parity this node received while it rebuilds, not yet "
                   "caught up with",
                   node.received_steps());
      out.AddGauge("moesnap_restore_buffer_bytes",
                   "Host memory (not pool) holding elastic restores' fetched bytes, in use or kept",
                   node.memory().restore_buffer_bytes());
      continue;
    }
    const metrics::Labels peer = {{"peer", absl::StrCat(node.node_id())}};
    out.AddGauge("moesnap_peer_up",
                 "1 while a daemon holds the peer's membership key in etcd, 0 when it is lost",
                 node.live() ? 1 : 0, peer);
  }
  out.AddGauge("moesnap_etcd_unreachable_seconds",
               "Seconds since this node last reached etcd (0 while it can): commits pause meanwhile",
               status.has_etcd_unreachable_since_unix_ms()
                   ? std::max<double>(0, absl::ToUnixMillis(absl::Now()) -
                                             status.etcd_unreachable_since_unix_ms()) /
                         1000.0
                   : 0);
  out.AddGauge("moesnap_cluster_coordinator_token", "The coordinator's fencing token",
               status.coordinator_token());
  out.AddCounter("moesnap_cluster_etcd_writes_total", "etcd writes this node made for the cluster",
                 status.etcd_writes());
  out.AddCounter("moesnap_cluster_peer_calls_total", "Peer service calls this node made",
                 status.peer_calls());
  if (status.has_latest_committed_step()) {
    out.AddGauge("moesnap_cluster_latest_committed_step", "This node's latest committed step",
                 status.latest_committed_step());
  }
  out.AddCounter("moesnap_encodes_total", "Steps this node encoded, by how they were sent",
                 status.full_encodes(), {{"kind", "full"}});
  out.AddCounter("moesnap_encodes_total", "Steps this node encoded, by how they were sent",
                 status.delta_encodes(), {{"kind", "delta"}});
  out.AddCounter("moesnap_parity_sent_bytes_total", "Bytes this node sent to parity holders",
                 status.parity_bytes_sent());
  out.AddCounter("moesnap_data_connections_closed_total",
                 "Data-plane connections this node closed over a frame malformed, damaged, refused "
                 "or cut short",
                 status.data_connections_closed());
  out.AddCounter("moesnap_cluster_degraded_commits_total",
                 "Steps this node committed with nodes absent (cluster.allow_degraded)",
                 status.degraded_commits());
  out.AddGauge("moesnap_cluster_absent_nodes",
               "Nodes absent from the latest step this node committed: their data is frozen at "
               "their last committed image until a replacement rebuilds them",
               status.absent_nodes_size());
}

// The durable tier's drain: progress, outcomes and the newest step on disk. Its lag behind memory
// is cluster_latest_committed_step - durable_latest_step.
void CollectDurable(durable::RestoreTiers& tiers, metrics::Collection& out) {
  const v1::DurableStatus status = tiers.DurableStatus();
  out.AddGauge("moesnap_durable_enabled", "1 when [durable] directory is set", status.enabled() ? 1 : 0);
  if (!status.enabled()) return;
  if (status.has_latest_step()) {
    out.AddGauge("moesnap_durable_latest_step", "The newest step complete on this node's disk",
                 status.latest_step());
  }
  out.AddGauge("moesnap_durable_draining", "1 while a step is being written to disk",
               status.has_draining_step() ? 1 : 0);
  out.AddGauge("moesnap_durable_draining_written_bytes", "Bytes of the step being drained written so far",
               status.draining_bytes_written());
  out.AddGauge("moesnap_durable_draining_bytes", "Bytes of the step being drained", status.draining_bytes());
  const char* help = "Drains since the daemon started, by outcome";
  out.AddCounter("moesnap_durable_drains_total", help, status.drains_completed(), {{"outcome", "completed"}});
  out.AddCounter("moesnap_durable_drains_total", help, status.drains_failed(), {{"outcome", "failed"}});
  out.AddCounter("moesnap_durable_drains_total", help, status.drains_skipped(), {{"outcome", "skipped"}});
  out.AddGauge("moesnap_durable_last_drain_seconds", "Duration of the last completed drain",
               status.last_drain_seconds());
  out.AddGauge("moesnap_durable_last_drain_bytes", "Bytes of the last completed drain",
               status.last_drain_bytes());
}

void CollectOperations(metrics::Collection& out) {
  // Summed per kind: two verifies at once are one series, as Prometheus needs.
  std::map<std::pair<std::string, std::string>, v1::OperationProgress> kinds;
  for (const v1::OperationProgress& operation : ProgressBoard::Default().Running()) {
    v1::OperationProgress& sum = kinds[{operation.kind(), operation.unit()}];
    sum.set_done(sum.done() + operation.done());
    sum.set_total(sum.total() + operation.total());
    sum.set_seconds(std::max(sum.seconds(), operation.seconds()));
  }
  for (const auto& [kind, operation] : kinds) {
    const metrics::Labels labels = {{"operation", kind.first}, {"unit", kind.second}};
    out.AddGauge("moesnap_operation_done", "Work running long operations have done", operation.done(),
                 labels);
    out.AddGauge("moesnap_operation_total", "Work running long operations know of",
                 operation.total(), labels);
    out.AddGauge("moesnap_operation_seconds", "Seconds since the oldest running operation began",
                 operation.seconds(), labels);
  }
}

}  // namespace

metrics::CollectorHandle CollectDaemonMetrics(metrics::Registry& registry, Store* store,
                                              TrainerSessions* sessions, UpstreamLog* log,
                                              Cluster* cluster, durable::RestoreTiers* tiers) {
  return registry.AddCollector([store, sessions, log, cluster, tiers](metrics::Collection& out) {
    CollectStore(*store, out);
    CollectTrainerMemory(*sessions, out);
    CollectLog(*log, out);
    if (cluster != nullptr) CollectCluster(*cluster, out);
    if (tiers != nullptr) CollectDurable(*tiers, out);
    CollectOperations(out);
  });
}

}  // namespace moesnap::daemon
