// NodeTable: liveness from the time a peer was last heard.
#include "daemon/cluster/node_table.h"

#include "absl/time/clock.h"
#include "common/log.h"

namespace moesnap::daemon::cluster {

NodeTable::NodeTable(uint32_t self, const std::vector<ClusterNode>& nodes, absl::Duration liveness)
    : self_(self), liveness_(liveness) {
  for (const ClusterNode& node : nodes) entries_[node.id].address = node;
}

std::vector<uint32_t> NodeTable::Ids() const {
  absl::MutexLock lock(&mutex_);
  std::vector<uint32_t> ids;
  for (const auto& [id, entry] : entries_) ids.push_back(id);
  return ids;
}

std::vector<uint32_t> NodeTable::LiveIds() const {
  absl::MutexLock lock(&mutex_);
  std::vector<uint32_t> ids;
  for (const auto& [id, entry] : entries_) {
    if (LiveLocked(id)) ids.push_back(id);
  }
  return ids;
}

bool NodeTable::LiveLocked(uint32_t id) const {
  if (id == self_) return true;
  auto it = entries_.find(id);
  return it != entries_.end() && it->second.refused.empty() &&
         absl::Now() - it->second.last_seen < liveness_;
}

bool NodeTable::Live(uint32_t id) const {
  absl::MutexLock lock(&mutex_);
  return LiveLocked(id);
}

std::optional<NodeView> NodeTable::View(uint32_t id) const {
  absl::MutexLock lock(&mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return std::nullopt;
  return NodeView{it->second.address, LiveLocked(id), it->second.incarnation,
                  id == self_ ? absl::Now() : it->second.last_seen, it->second.report};
}

std::optional<ClusterNode> NodeTable::Address(uint32_t id) const {
  absl::MutexLock lock(&mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return std::nullopt;
  return it->second.address;
}

uint64_t NodeTable::Incarnation(uint32_t id) const {
  absl::MutexLock lock(&mutex_);
  auto it = entries_.find(id);
  return it == entries_.end() ? 0 : it->second.incarnation;
}

bool NodeTable::NoteLiveness(uint32_t id, Entry& entry) {
  const bool live = LiveLocked(id);
  if (live == entry.was_live) return false;
  entry.was_live = live;
  if (!live) ++entry.incarnation;  // whatever answers next is a new process, or a new connection
  return true;
}

bool NodeTable::Heard(uint32_t id, const v1::HeartbeatResponse& report) {
  absl::MutexLock lock(&mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return false;
  it->second.last_seen = absl::Now();
  it->second.report = report;
  it->second.refused.clear();
  return NoteLiveness(id, it->second);
}

bool NodeTable::Missed(uint32_t id, std::optional<std::string> refusal) {
  absl::MutexLock lock(&mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return false;
  if (refusal) {
    if (it->second.refused.empty()) {
      Log(LogLevel::kError, "node ", id, " refuses this node: ", *refusal);
    }
    it->second.refused = *std::move(refusal);
  }
  return NoteLiveness(id, it->second);
}

}  // namespace moesnap::daemon::cluster
