// Log forwarding: a trainer asks its own daemon for the upstream-log records of a neighbouring rank
// that ran elsewhere; this node asks every other live node, and the one that holds the rank's log
// answers.
#ifndef MOESNAP_DAEMON_CLUSTER_LOG_FORWARDING_H_
#define MOESNAP_DAEMON_CLUSTER_LOG_FORWARDING_H_

#include "absl/status/statusor.h"
#include "daemon/cluster/context.h"
#include "daemon/upstream_log.h"

namespace moesnap::daemon::cluster {

// Thread-safe.
class LogForwarding {
 public:
  LogForwarding(const ClusterContext& context, UpstreamLog* log);

  // Records of a rank that ran on another node, from whichever live node holds them.
  absl::StatusOr<v1::FetchLogResponse> FetchRemote(const v1::FetchLogRequest& request);
  // The serving side: this node's own records (NOT_FOUND when it holds no log of the rank).
  absl::StatusOr<v1::FetchLogResponse> FetchLocal(const v1::FetchLogRequest& request);

 private:
  const ClusterContext context_;
  UpstreamLog* const log_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_LOG_FORWARDING_H_
