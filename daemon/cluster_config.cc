// ClusterOptions: validation, groups, and the canonical form digests and differences come from.
#include "daemon/cluster_config.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "erasure/stripe_layout.h"

namespace moesnap::daemon {
namespace {

std::string NodeText(const ClusterNode& node) {
  return absl::StrCat(node.id, "@", node.host, ":", node.control_port, "/", node.data_port);
}

}  // namespace

absl::Status ClusterOptions::Validate(uint32_t self) {
  if (absl::StatusOr<erasure::StripeLayout> layout =
          erasure::StripeLayout::Create(data_units, parity_units, stripe_unit_bytes);
      !layout.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cluster: ", layout.status().message()));
  }
  if (commit_timeout_ms < 100) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster.commit_timeout_ms must be at least 100, got ", commit_timeout_ms));
  }
  if (heartbeat_timeout_ms < 100) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster.heartbeat_timeout_ms must be at least 100, got ", heartbeat_timeout_ms));
  }
  std::sort(nodes.begin(), nodes.end(),
            [](const ClusterNode& a, const ClusterNode& b) { return a.id < b.id; });
  std::set<std::string> endpoints;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const ClusterNode& node = nodes[i];
    if (i > 0 && nodes[i - 1].id == node.id) {
      return absl::InvalidArgumentError(absl::StrCat("cluster.nodes: node id ", node.id, " appears twice"));
    }
    if (node.host.empty() || node.control_port == 0 || node.data_port == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cluster.nodes: node ", node.id, " needs a host, a control_port and a data_port"));
    }
    for (uint16_t port : {node.control_port, node.data_port}) {
      if (!endpoints.insert(absl::StrCat(node.host, ":", port)).second) {
        return absl::InvalidArgumentError(absl::StrCat("cluster.nodes: ", node.host, ":", port,
                                                       " is used twice (node ", node.id, ")"));
      }
    }
  }
  if (nodes.size() % group_size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster: ", nodes.size(), " nodes cannot form groups of k + m = ", group_size(),
        "; the node count must be a multiple of the group size"));
  }
  if (!GroupOf(self)) {
    return absl::InvalidArgumentError(
        absl::StrCat("node.id ", self, " is not among cluster.nodes"));
  }
  return absl::OkStatus();
}

std::vector<std::vector<uint32_t>> ClusterOptions::Groups() const {
  std::vector<std::vector<uint32_t>> groups;
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (i % group_size() == 0) groups.emplace_back();
    groups.back().push_back(nodes[i].id);
  }
  return groups;
}

std::optional<std::pair<int, int>> ClusterOptions::GroupOf(uint32_t id) const {
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].id == id) {
      return std::pair<int, int>(static_cast<int>(i) / group_size(), static_cast<int>(i) % group_size());
    }
  }
  return std::nullopt;
}

std::string ClusterOptions::Canonical() const {
  std::string text = absl::StrCat("k=", data_units, ";m=", parity_units, ";unit=", stripe_unit_bytes,
                                  ";heartbeat_ms=", heartbeat_timeout_ms,
                                  ";commit_ms=", commit_timeout_ms,
                                  ";degraded=", allow_degraded ? 1 : 0, ";nodes=");
  for (const ClusterNode& node : nodes) absl::StrAppend(&text, NodeText(node), ",");
  return text;
}

uint64_t ClusterOptions::Digest() const {
  uint64_t hash = 0xcbf29ce484222325ULL;  // FNV-1a, 64 bits: stable across builds and machines
  for (unsigned char c : Canonical()) {
    hash ^= c;
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

std::string ClusterOptions::DifferenceFrom(const ClusterOptions& other) const {
  auto differs = [](const std::string& field, const auto& here, const auto& there) {
    return absl::StrCat(field, ": ", here, " here, ", there, " there");
  };
  if (data_units != other.data_units) return differs("data_units", data_units, other.data_units);
  if (parity_units != other.parity_units) return differs("parity_units", parity_units, other.parity_units);
  if (stripe_unit_bytes != other.stripe_unit_bytes) {
    return differs("stripe_unit_bytes", stripe_unit_bytes, other.stripe_unit_bytes);
  }
  if (heartbeat_timeout_ms != other.heartbeat_timeout_ms) {
    return differs("heartbeat_timeout_ms", heartbeat_timeout_ms, other.heartbeat_timeout_ms);
  }
  if (commit_timeout_ms != other.commit_timeout_ms) {
    return differs("commit_timeout_ms", commit_timeout_ms, other.commit_timeout_ms);
  }
  if (allow_degraded != other.allow_degraded) {
    return differs("allow_degraded", allow_degraded, other.allow_degraded);
  }
  for (size_t i = 0; i < std::max(nodes.size(), other.nodes.size()); ++i) {
    const std::string here = i < nodes.size() ? NodeText(nodes[i]) : "(none)";
    const std::string there = i < other.nodes.size() ? NodeText(other.nodes[i]) : "(none)";
    if (here != there) return differs(absl::StrCat("node #", i), here, there);
  }
  return "";
}

}  // namespace moesnap::daemon
