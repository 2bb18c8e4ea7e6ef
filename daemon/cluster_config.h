// The job's cluster as every daemon must see it: the nodes (id, host, control and data ports) and the
// Reed-Solomon shape of their groups. Groups are formed deterministically: nodes sorted by id, cut
// into consecutive groups of k + m. Daemons compare digests when they join and refuse a peer whose
// cluster differs, naming the first difference. A config without a cluster is a single node.
#ifndef MOESNAP_DAEMON_CLUSTER_CONFIG_H_
#define MOESNAP_DAEMON_CLUSTER_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace moesnap::daemon {

struct ClusterNode {
  uint32_t id = 0;
  std::string host;
  uint16_t control_port = 0;
  uint16_t data_port = 0;
};

struct ClusterOptions {
  int data_units = 4;    // k
  int parity_units = 2;  // m
  uint64_t stripe_unit_bytes = uint64_t{4} << 20;
  uint32_t heartbeat_timeout_ms = 10000;  // a node silent this long is marked lost
  uint32_t commit_timeout_ms = 60000;     // a step's trainers must capture it within this time
  bool allow_degraded = false;            // keep snapshotting with lost nodes in a group
  std::vector<ClusterNode> nodes;         // sorted by id once validated

  // Checks the shape and the nodes, and that `self` is one of them; sorts nodes by id.
  absl::Status Validate(uint32_t self);
  int group_size() const { return data_units + parity_units; }
  // Groups of node ids, in order; node i of group g is at position i.
  std::vector<std::vector<uint32_t>> Groups() const;
  // The group and position of node `id` (nullopt when not a member).
  std::optional<std::pair<int, int>> GroupOf(uint32_t id) const;

  // One line that two daemons with the same cluster print identically; Digest hashes it.
  std::string Canonical() const;
  uint64_t Digest() const;
  // Empty when equal; otherwise the first difference, e.g. "parity_units: 2 here, 3 there".
  std::string DifferenceFrom(const ClusterOptions& other) const;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_CLUSTER_CONFIG_H_
