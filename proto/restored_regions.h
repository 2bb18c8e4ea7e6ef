// The regions a restore wrote (RestoredRegions): added one at a time by the daemon, read back whole
// by whoever receives them, every column checked against the others first.
#ifndef MOESNAP_PROTO_RESTORED_REGIONS_H_
#define MOESNAP_PROTO_RESTORED_REGIONS_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/moesnap.pb.h"

namespace moesnap {

struct RestoredRegionView {
  std::string_view name;  // into the RestoredRegions it was read from
  int64_t step = 0;       // the step whose bytes the region now holds
  uint64_t bytes = 0;
  const v1::RegionPiece* piece = nullptr;  // a member's piece of a replica group; null: the region
};

// Makes room for `count` regions.
void ReserveRestored(v1::RestoredRegions& restored, int count);

// Appends a region to `restored`; `piece` (may be null) is copied.
void AddRestored(v1::RestoredRegions& restored, std::string_view name, int64_t step, uint64_t bytes,
                 const v1::RegionPiece* piece = nullptr);

// The regions `restored` lists, in order, their names viewing `restored`'s; DATA_LOSS when its
// columns disagree (a hostile or broken peer).
absl::StatusOr<std::vector<RestoredRegionView>> ReadRestored(const v1::RestoredRegions& restored);

// ReadRestored of `response`'s regions. Every daemon that lists them as columns sets them, even
// when empty: an answer without them comes from a daemon older than this reader, and is refused
// (FAILED_PRECONDITION, saying so) rather than read as a restore of no regions.
absl::StatusOr<std::vector<RestoredRegionView>> ReadRestored(const v1::RestoreResponse& response);

}  // namespace moesnap

#endif  // MOESNAP_PROTO_RESTORED_REGIONS_H_
