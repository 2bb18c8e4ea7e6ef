// moesnapd's configuration: one TOML file whose tables map to the Options struct of each component.
// A missing key takes the component's default; an unknown or malformed key is an error naming the
// key and the file. deploy/moesnapd.toml documents every key.
#ifndef MOESNAP_DAEMON_CONFIG_H_
#define MOESNAP_DAEMON_CONFIG_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "daemon/cluster_config.h"
#include "daemon/http_server.h"
#include "daemon/durable/durable_options.h"
#include "daemon/pool.h"
#include "daemon/store.h"
#include "daemon/upstream_log.h"

namespace moesnap::daemon {

// Who may connect to a socket: the daemon's own uid, root, members of `group`, and `allowed_uids`.
struct AccessOptions {
  std::string group;  // owns the sockets (0660); empty: the daemon's own group
  std::vector<uid_t> allowed_uids;
};

// Crashes and delays on purpose, for the crash and cluster tests. Only moesnapd-faults, the test
// build of the daemon, sets them (from MOESNAP_CRASH_IN_JOURNAL_WRITE, MOESNAP_CRASH_IN_COMMIT and
// MOESNAP_REBUILD_HOLD_STEPS); moesnapd never does.
struct FaultInjection {
  std::optional<int64_t> crash_in_journal_write;  // SIGKILL half-way through this journal write
  std::optional<int64_t> crash_in_commit;  // as coordinator, SIGKILL right after deciding this step
  // A rebuild that decoded step S installs it only once step S + this or a later one is committed.
  std::optional<int64_t> rebuild_hold_steps;
};

// The agent socket's gRPC server runs each trainer call on a thread of its own, and some calls wait
// up to an hour (WaitCommitted, Restore), so its threads are capped: a call beyond the cap is
// refused RESOURCE_EXHAUSTED, never queued. By default the cap holds kAgentRanksSized ranks each at
// its bound of calls in flight (AgentService::kCallsPerRank, 16; a trainer has one to three), 64 x
// 16 = 1024, and 64 more for the calls that name no rank (Hello, FetchLog) and gRPC's own polling
// threads (one always waits for the next call, and up to two idle ones stay).
inline constexpr int kAgentRanksSized = 64;
inline constexpr int kDefaultAgentMaxThreads = kAgentRanksSized * 16 + 64;

struct DaemonOptions {
  uint32_t node_id = 0;
  std::string agent_socket = "/run/moesnap/agent.sock";
  std::string admin_socket = "/run/moesnap/admin.sock";
  AccessOptions access;  // the agent socket (trainers)
  int agent_max_threads = kDefaultAgentMaxThreads;
  // How long the larger shared-memory files of a trainer that exited are kept for its rank's next
  // process, which takes them instead of allocating (TrainerSessions); zero: released at once.
  absl::Duration exited_trainer_memory_retention = absl::Minutes(5);
  // At most this much of it is kept at once, the memory kept longest released first to make room;
  // none: half the host's memory.
  std::optional<uint64_t> exited_trainer_memory_max_bytes;
  // The admin socket (operators): it drops steps and exports every rank's state, so trainers'
  // group is not let in; [admin] group names the operators' group, if any.
  AccessOptions admin_access;
  PoolOptions pool;
  CaptureOptions capture;
  UpstreamLogOptions upstream_log;
  HttpOptions http;  // /metrics, /healthz, /readyz
  durable::DurableOptions durable;
  LogLevel log_level = LogLevel::kInfo;
  LogFormat log_format = LogFormat::kText;
  // Absent: a single node, no peers.
  std::optional<ClusterOptions> cluster;
  FaultInjection faults;
};

absl::StatusOr<DaemonOptions> LoadDaemonOptions(const std::string& path);
// The same from TOML text; `origin` names it in errors.
absl::StatusOr<DaemonOptions> ParseDaemonOptions(const std::string& text, const std::string& origin);

// This node's id and advertised address when they do not come from the file: from the command
// line, else from MOESNAP_NODE_ID and MOESNAP_ADVERTISE_HOST, so that one file serves every node
// of a Slurm or Kubernetes job.
struct NodeIdentity {
  std::optional<uint32_t> node_id;
  std::optional<std::string> advertise_host;
};
absl::StatusOr<NodeIdentity> NodeIdentityFromEnvironment();
// Puts `identity` over what the file said and checks the node's part of the cluster (an id below
// node_count, an address to advertise).
absl::Status ApplyNodeIdentity(const NodeIdentity& identity, DaemonOptions* options);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_CONFIG_H_
