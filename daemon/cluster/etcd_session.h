// This daemon's session with the job's etcd: the client, the lease every key of this node lives
// under (kept alive in the background, granted again after it is lost), whether etcd can be reached
// and since when not, and how many writes the cluster made. While etcd cannot be reached, captures
// go on and commits pause; the session keeps trying and the cluster resumes by itself.
#ifndef MOESNAP_DAEMON_CLUSTER_ETCD_SESSION_H_
#define MOESNAP_DAEMON_CLUSTER_ETCD_SESSION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/cluster_config.h"
#include "daemon/etcd/etcd_client.h"

namespace moesnap::daemon::cluster {

// Thread-safe.
class EtcdSession {
 public:
  // Checks the options and starts keeping a lease; etcd may be down meanwhile.
  // Reaches etcd as node `node_id` does (ClusterOptions::EtcdTls).
  static absl::StatusOr<std::unique_ptr<EtcdSession>> Start(const ClusterOptions& options,
                                                            uint32_t node_id);
  ~EtcdSession();  // revokes the lease, so this node's keys go at once

  etcd::Client& client() { return *client_; }
  absl::Duration lease_ttl() const { return ttl_; }

  // The lease this node's keys live under, waiting for one (up to `deadline`) while there is none.
  absl::StatusOr<int64_t> WaitLease(absl::Time deadline);
  // Whether `lease` is still held (not lost, not replaced).
  bool Holds(int64_t lease) const;
  // Waits until the lease changes from `lease` (lost, or a new one granted) or `deadline`.
  void WaitLeaseChange(int64_t lease, absl::Time deadline) const;

  // Callers report each etcd call's outcome: failures that say etcd cannot be reached start the
  // "unreachable since" clock, any success stops it.
  void Note(const absl::Status& status);
  // A write the cluster made (for the per-step figures).
  void CountWrite() { ++writes_; }
  std::optional<absl::Time> unreachable_since() const;
  uint64_t writes() const { return writes_; }
  uint64_t keep_alives() const;

 private:
  EtcdSession(std::unique_ptr<etcd::Client> client, absl::Duration ttl);
  void KeepLeases();
  bool Sleep(absl::Duration duration);  // false when stopping

  const std::unique_ptr<etcd::Client> client_;
  const absl::Duration ttl_;
  std::atomic<uint64_t> writes_{0};

  mutable absl::Mutex mutex_;
  mutable absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  int64_t lease_ ABSL_GUARDED_BY(mutex_) = 0;  // 0: none held
  std::optional<absl::Time> unreachable_since_ ABSL_GUARDED_BY(mutex_);
  uint64_t keep_alives_ ABSL_GUARDED_BY(mutex_) = 0;  // renewals of leases before the current one
  std::unique_ptr<etcd::LeaseKeeper> keeper_ ABSL_GUARDED_BY(mutex_);
  std::thread thread_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_ETCD_SESSION_H_
