// Topology::Create: the stripe layout and codec of the job's shape, and this node's place in it.
#include "daemon/cluster/context.h"

#include "absl/strings/str_cat.h"

namespace moesnap::daemon::cluster {

absl::StatusOr<std::unique_ptr<const Topology>> Topology::Create(uint32_t node_id,
                                                                 const ClusterOptions& options) {
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
  return std::unique_ptr<const Topology>(new Topology{node_id, options, *std::move(layout),
                                                      *std::move(codec), options.Groups(),
                                                      place->first, place->second});
}

}  // namespace moesnap::daemon::cluster
