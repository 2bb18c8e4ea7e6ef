// Membership on etcd: this daemon holds its node id's key (address, ports, config digest) under its
// lease, and keeps the node table current from the job's member keys and the coordinator's election.
// A lost node is an expired lease; a replacement for node id N may come from any host and address,
// and takes the key once the old one is gone. A daemon whose job config differs from a member's does
// not join, and names the difference.
#ifndef MOESNAP_DAEMON_CLUSTER_MEMBERSHIP_H_
#define MOESNAP_DAEMON_CLUSTER_MEMBERSHIP_H_

#include <cstdint>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/etcd_keys.h"
#include "daemon/cluster/etcd_session.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

// The job-wide part of a config, as members record it.
v1::ClusterShape ShapeOf(const ClusterOptions& options);

// Thread-safe.
class Membership {
 public:
  Membership(const ClusterContext& context, EtcdSession* session, const EtcdKeys& keys);
  ~Membership();  // stops; the session's lease revocation removes this node's key

  // Compares this node's config with every member's; the first difference is the error.
  absl::Status CheckConfig();
  // Keeps this node registered as `self` (waiting while another daemon holds its id, again after
  // a lost lease) and the node table current.
  void Start(const v1::MemberRecord& self);

  // Whether this daemon holds its node id's key now; waits up to `deadline` for it.
  bool WaitRegistered(absl::Time deadline) const;
  // Times this daemon registered (1 at start; more after lost leases).
  int registrations() const;
  // The create revision of this node's member key while this daemon holds it: a write fenced by it
  // applies only while this daemon is the node's (not a replacement, not after a lost lease).
  std::optional<int64_t> incarnation() const;

 private:
  void RegisterLoop(v1::MemberRecord self);
  void WatchMembers();
  void WatchLeader();
  // Reads the members or the leader into the node table; the read's revision.
  absl::StatusOr<int64_t> ReadMembers();
  absl::StatusOr<int64_t> ReadLeader();
  bool stopping() const;

  const ClusterContext context_;
  EtcdSession* const session_;
  const EtcdKeys keys_;

  mutable absl::Mutex mutex_;
  mutable absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  bool registered_ ABSL_GUARDED_BY(mutex_) = false;
  int registrations_ ABSL_GUARDED_BY(mutex_) = 0;
  std::optional<int64_t> incarnation_ ABSL_GUARDED_BY(mutex_);
  std::vector<std::thread> threads_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_MEMBERSHIP_H_
