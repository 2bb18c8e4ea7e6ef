// Who the job's nodes are, where they are reached, and which are live, as this node knows it now.
// Membership writes it; every other unit only reads it. A node's incarnation changes each time it
// is lost, so connections made to an earlier incarnation are dropped and made again.
#ifndef MOESNAP_DAEMON_CLUSTER_NODE_TABLE_H_
#define MOESNAP_DAEMON_CLUSTER_NODE_TABLE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/cluster_config.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

struct NodeView {
  ClusterNode address;
  bool live = false;
  uint64_t incarnation = 0;
  absl::Time last_seen = absl::InfinitePast();  // this node: always now
  v1::HeartbeatResponse report;                 // what it said when last heard
};

// Thread-safe.
class NodeTable {
 public:
  // `nodes` is every node of the job; a peer is live while heard within `liveness` and not
  // refusing this node. This node is always live.
  NodeTable(uint32_t self, const std::vector<ClusterNode>& nodes, absl::Duration liveness);

  // Every node id of the job, in order.
  std::vector<uint32_t> Ids() const;
  std::vector<uint32_t> LiveIds() const;
  bool Live(uint32_t id) const;
  std::optional<NodeView> View(uint32_t id) const;
  std::optional<ClusterNode> Address(uint32_t id) const;
  uint64_t Incarnation(uint32_t id) const;

  // Membership's side. Heard: `id` answered with `report`. Missed: it did not answer (or refused
  // this node, when `refusal` is set). Each returns true when the node's liveness changed.
  bool Heard(uint32_t id, const v1::HeartbeatResponse& report);
  bool Missed(uint32_t id, std::optional<std::string> refusal);

 private:
  struct Entry {
    ClusterNode address;
    absl::Time last_seen = absl::InfinitePast();
    v1::HeartbeatResponse report;
    std::string refused;  // why it refused this node's config, if it did
    bool was_live = false;
    uint64_t incarnation = 0;
  };
  bool LiveLocked(uint32_t id) const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  // Records a liveness change of `entry`; true when it changed.
  bool NoteLiveness(uint32_t id, Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const uint32_t self_;
  const absl::Duration liveness_;
  mutable absl::Mutex mutex_;
  std::map<uint32_t, Entry> entries_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_NODE_TABLE_H_
