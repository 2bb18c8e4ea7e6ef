// Who holds each node id of the job, where it is reached and since which incarnation, and who
// coordinates, as this node last read it from etcd. Membership writes it; every other unit only
// reads it. A node is live while a daemon holds its membership key (under a lease); its incarnation
// is that key's create revision, so a replacement (even on the same address) is a new incarnation
// and connections made to an earlier one are made again.
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

namespace moesnap::daemon::cluster {

struct NodeView {
  uint32_t id = 0;
  bool live = false;
  ClusterNode address{};   // as the live daemon advertises it
  std::string hostname{};  // the machine it runs on
  int64_t incarnation = 0;
};

struct LeaderView {
  uint32_t node_id = 0;
  int64_t token = 0;  // the leader key's create revision
};

// Thread-safe.
class NodeTable {
 public:
  explicit NodeTable(uint32_t node_count);

  // Every node id of the job, in order.
  std::vector<uint32_t> Ids() const;
  std::vector<uint32_t> LiveIds() const;
  bool Live(uint32_t id) const;
  NodeView View(uint32_t id) const;
  // Where a live node is reached; nullopt while no daemon holds it.
  std::optional<ClusterNode> Address(uint32_t id) const;
  int64_t Incarnation(uint32_t id) const;
  std::optional<LeaderView> Leader() const;

  // Membership's side.
  void Set(const NodeView& view);
  void Remove(uint32_t id);
  void SetLeader(std::optional<LeaderView> leader);

  // A counter that moves with every change; WaitChange waits until it passes `seen`.
  uint64_t version() const;
  void WaitChange(uint64_t seen, absl::Time deadline) const;

 private:
  const uint32_t node_count_;
  mutable absl::Mutex mutex_;
  mutable absl::CondVar changed_;
  std::map<uint32_t, NodeView> live_ ABSL_GUARDED_BY(mutex_);
  std::optional<LeaderView> leader_ ABSL_GUARDED_BY(mutex_);
  uint64_t version_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_NODE_TABLE_H_
