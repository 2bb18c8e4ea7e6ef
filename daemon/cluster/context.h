// What every unit of the cluster shares and depends on: the facts fixed at start (this node, the
// job's shape, its stripe layout and codec, the groups), the node table (who is where and live)
// and the peer client. Units take a ClusterContext and never reach into one another's state
// through it; a unit test builds one around fakes.
#ifndef MOESNAP_DAEMON_CLUSTER_CONTEXT_H_
#define MOESNAP_DAEMON_CLUSTER_CONTEXT_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/cluster/node_table.h"
#include "daemon/cluster/peer_checks.h"
#include "daemon/cluster/peer_client.h"
#include "daemon/cluster_config.h"
#include "erasure/reed_solomon.h"
#include "erasure/stripe_layout.h"

namespace moesnap::daemon::cluster {

// Immutable once built; safe to share between threads.
struct Topology {
  // Checks the shape and that `node_id` is a member. `pool_bytes` (this node's pool) bounds what
  // a peer may ask this node to hold.
  static absl::StatusOr<std::unique_ptr<const Topology>> Create(uint32_t node_id,
                                                                const ClusterOptions& options,
                                                                uint64_t pool_bytes);

  // The node at `position` of `group` (of this node's group).
  uint32_t NodeAt(int in_group, int at) const { return groups[in_group][at]; }
  uint32_t NodeAt(int at) const { return NodeAt(group, at); }

  const uint32_t node_id;
  const ClusterOptions options;
  const erasure::StripeLayout layout;
  const std::unique_ptr<const erasure::ReedSolomon> codec;
  const std::vector<std::vector<uint32_t>> groups;
  const int group;     // this node's
  const int position;  // this node's, in its group
  const PeerLimits limits;  // what peers' requests are checked against
};

struct ClusterContext {
  const Topology* topology = nullptr;
  NodeTable* nodes = nullptr;
  PeerClient* peers = nullptr;
  // Mutual TLS with the job's peers (the data plane's connections); null: plaintext.
  std::shared_ptr<const PeerTls> tls;

  uint32_t node_id() const { return topology->node_id; }
  const ClusterOptions& options() const { return topology->options; }
  const erasure::StripeLayout& layout() const { return topology->layout; }
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_CONTEXT_H_
