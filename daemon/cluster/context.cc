// Topology::Create: the stripe layout and codec of the job's shape, and this node's place in it.
#include "daemon/cluster/context.h"

#include "absl/strings/str_cat.h"

namespace moesnap::daemon::cluster {

absl::StatusOr<std::unique_ptr<const Topology>> Topology::Create(uint32_t node_id,
                                                                 const ClusterOptions& options,
                                                                 uint64_t pool_bytes) {
  absl::StatusOr<erasure::StripeLayout> layout = erasure::StripeLayout::Create(
      options.data_units, options.parity_units, options.stripe_unit_bytes);
  if (!layout.ok()) return layout.status();
  absl::StatusOr<std::unique_ptr<erasure::ReedSolomon>> codec =
      erasure::ReedSolomon::Create(options.data_units, options.parity_units);
  if (!codec.ok()) return codec.status();
  const std::optional<std::pair<int, int>> place = options.GroupOf(node_id);
  if (!place) {
    return absl::InvalidArgumentError(absl::StrCat("node ", node_id, " is not in the cluster"));
  }
  // More data in a group than its pool times the group's size needs more parity than a pool of
  // this node's size holds: no member's image can be larger and still be encoded here.
  const uint64_t group_size = static_cast<uint64_t>(options.group_size());
  const uint64_t max_image_bytes =
      pool_bytes > UINT64_MAX / group_size ? UINT64_MAX : pool_bytes * group_size;
  const PeerLimits limits{options.node_count, options.group_size(), options.stripe_unit_bytes,
                          options.commit_timeout_ms, max_image_bytes};
  return std::unique_ptr<const Topology>(new Topology{node_id, options, *std::move(layout),
                                                      *std::move(codec), options.Groups(),
                                                      place->first, place->second, limits});
}

}  // namespace moesnap::daemon::cluster
