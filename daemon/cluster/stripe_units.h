// What a rebuild and its helpers share about a stripe's units: where each lies in the group, how
// many bytes it holds, and fetching units from the nodes that hold them.
#ifndef MOESNAP_DAEMON_CLUSTER_STRIPE_UNITS_H_
#define MOESNAP_DAEMON_CLUSTER_STRIPE_UNITS_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/cluster/parallel.h"
#include "daemon/cluster/transfer.h"
#include "erasure/stripe_layout.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

// The data bytes of each group member's image of the step `record` holds.
inline std::vector<uint64_t> ImageSizes(const v1::JournalCluster& record) {
  std::vector<uint64_t> sizes;
  for (const v1::NodeImage& image : record.group_images()) sizes.push_back(image.bytes());
  return sizes;
}

// The group position of unit `unit` (0..k-1 data, k..n-1 parity) of `stripe`.
inline int PositionOf(const erasure::StripeLayout& layout, uint64_t stripe, int unit) {
  const erasure::StripeMembers members = layout.Members(stripe);
  const int k = layout.data_units();
  return unit < k ? members.data_positions[unit] : members.parity_positions[unit - k];
}

// The bytes unit `unit` of `stripe` holds: a data unit's own (0 past its image's end), a parity
// unit's `length`, the stripe's.
inline uint64_t UnitBytes(const erasure::StripeLayout& layout, const std::vector<uint64_t>& sizes,
                          uint64_t stripe, int unit, uint64_t length) {
  if (unit >= layout.data_units()) return length;
  const int position = PositionOf(layout, stripe, unit);
  return layout.UnitLength(sizes[position], layout.DataUnitOf(position, stripe));
}

// What decoding a stripe of units of `length` bytes takes at a helper: its k sources and the unit
// it decodes.
inline uint64_t HelperStripeBytes(const erasure::StripeLayout& layout, uint64_t length) {
  return length * static_cast<uint64_t>(layout.data_units() + 1);
}

// The bytes a request to a helper may take at the helper: `request_bytes`, or one stripe's where
// it takes more (RebuildOptions::helper_request_bytes).
inline uint64_t HelperRequestBound(const erasure::StripeLayout& layout, uint64_t request_bytes) {
  return std::max(request_bytes, HelperStripeBytes(layout, layout.unit_bytes()));
}

// Registers `slots`, has every node of `requests` push its part over the data plane (`call`, all
// nodes at once), and waits for every byte: OK, or the first failure naming its node.
template <typename Request, typename Call>
absl::Status FetchFrom(Transfer* transfer,
                       const std::vector<std::pair<FetchKey, FetchSlot>>& slots,
                       const std::map<uint32_t, Request>& requests, Call call) {
  if (absl::Status expected = transfer->Expect(slots); !expected.ok()) return expected;
  std::vector<uint32_t> nodes;
  for (const auto& [id, request] : requests) nodes.push_back(id);
  const std::vector<absl::Status> sent = InParallel(nodes, [&](uint32_t id) -> absl::Status {
    const absl::Status status = call(id, requests.at(id));
    if (status.ok()) return status;
    return absl::Status(status.code(), absl::StrCat("node ", id, ": ", status.message()));
  });
  absl::Status status;
  for (const absl::Status& one : sent) status.Update(one);
  std::vector<FetchKey> keys;
  for (const auto& [key, slot] : slots) keys.push_back(key);
  return transfer->Collect(keys, status);
}

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_STRIPE_UNITS_H_
