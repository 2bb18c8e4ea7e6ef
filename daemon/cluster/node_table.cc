// NodeTable: the live members and the leader, with a version to wait on.
#include "daemon/cluster/node_table.h"

namespace moesnap::daemon::cluster {

NodeTable::NodeTable(uint32_t node_count) : node_count_(node_count) {}

std::vector<uint32_t> NodeTable::Ids() const {
  std::vector<uint32_t> ids;
  for (uint32_t id = 0; id < node_count_; ++id) ids.push_back(id);
  return ids;
}

std::vector<uint32_t> NodeTable::LiveIds() const {
  absl::MutexLock lock(&mutex_);
  std::vector<uint32_t> ids;
  for (const auto& [id, view] : live_) ids.push_back(id);
  return ids;
}

bool NodeTable::Live(uint32_t id) const {
  absl::MutexLock lock(&mutex_);
  return live_.contains(id);
}

NodeView NodeTable::View(uint32_t id) const {
  absl::MutexLock lock(&mutex_);
  auto it = live_.find(id);
  if (it == live_.end()) return NodeView{.id = id};
  return it->second;
}

std::optional<ClusterNode> NodeTable::Address(uint32_t id) const {
  absl::MutexLock lock(&mutex_);
  auto it = live_.find(id);
  if (it == live_.end()) return std::nullopt;
  return it->second.address;
}

int64_t NodeTable::Incarnation(uint32_t id) const {
  absl::MutexLock lock(&mutex_);
  auto it = live_.find(id);
  return it == live_.end() ? 0 : it->second.incarnation;
}

std::optional<LeaderView> NodeTable::Leader() const {
  absl::MutexLock lock(&mutex_);
  return leader_;
}

void NodeTable::Set(const NodeView& view) {
  if (view.id >= node_count_) return;
  absl::MutexLock lock(&mutex_);
  NodeView& stored = live_[view.id];
  stored = view;
  stored.live = true;
  ++version_;
  changed_.SignalAll();
}

void NodeTable::Remove(uint32_t id) {
  absl::MutexLock lock(&mutex_);
  if (live_.erase(id) > 0) {
    ++version_;
    changed_.SignalAll();
  }
}

void NodeTable::SetLeader(std::optional<LeaderView> leader) {
  absl::MutexLock lock(&mutex_);
  const bool same = leader_.has_value() == leader.has_value() &&
                    (!leader || (leader_->node_id == leader->node_id &&
                                 leader_->token == leader->token));
  if (same) return;
  leader_ = leader;
  ++version_;
  changed_.SignalAll();
}

uint64_t NodeTable::version() const {
  absl::MutexLock lock(&mutex_);
  return version_;
}

void NodeTable::WaitChange(uint64_t seen, absl::Time deadline) const {
  absl::MutexLock lock(&mutex_);
  while (version_ == seen) {
    if (changed_.WaitWithDeadline(&mutex_, deadline)) return;
  }
}

}  // namespace moesnap::daemon::cluster
