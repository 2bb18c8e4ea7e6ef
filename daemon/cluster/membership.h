// Membership by heartbeats: every node asks every other one every heartbeat interval; a peer that
// has not answered for the heartbeat timeout is lost. A daemon joins only if every peer that
// answers has the same cluster config (the first difference is named). The coordinator is the
// lowest live node.
#ifndef MOESNAP_DAEMON_CLUSTER_MEMBERSHIP_H_
#define MOESNAP_DAEMON_CLUSTER_MEMBERSHIP_H_

#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/cluster/context.h"

namespace moesnap::daemon::cluster {

// Heartbeats go this often for a given heartbeat timeout.
absl::Duration HeartbeatInterval(const ClusterOptions& options);

// Thread-safe.
class Membership {
 public:
  explicit Membership(const ClusterContext& context);
  ~Membership();  // stops the heartbeats

  // Shows this node's config to every peer that answers now; any refusal is the error.
  absl::Status Join();
  // Starts heartbeating every peer.
  void Start();

  // A peer's heartbeat: OK when its config equals this node's; otherwise why not.
  absl::Status CheckPeer(const v1::HeartbeatRequest& request) const;
  // The lowest live node.
  uint32_t Coordinator() const;
  // OK when `coordinator` is the lowest live node as this node sees it.
  absl::Status CheckCoordinator(uint32_t coordinator) const;

 private:
  void HeartbeatLoop(uint32_t peer);
  // False when stopping.
  bool SleepUnlessStopping(absl::Duration duration);

  const ClusterContext context_;
  const absl::Duration interval_;
  const uint64_t digest_;  // of the config, sent with every heartbeat

  absl::Mutex mutex_;
  absl::CondVar stopping_changed_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_MEMBERSHIP_H_
