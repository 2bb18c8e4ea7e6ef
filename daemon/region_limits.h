// Bounds on what a trainer may describe a region with. Every registration is kept in the journal,
// which all ranks of the node share: one rank's endless names must not fill it for everyone.
#ifndef MOESNAP_DAEMON_REGION_LIMITS_H_
#define MOESNAP_DAEMON_REGION_LIMITS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

inline constexpr size_t kMaxRegionNameBytes = 1024;
inline constexpr size_t kMaxDtypeBytes = 64;
inline constexpr int kMaxShapeDimensions = 64;

// INVALID_ARGUMENT naming the region and the limit it exceeds: an empty or too long name, a too
// long dtype, too many dimensions, 0 bytes.
absl::Status CheckRegionSpec(const v1::RegionSpec& spec);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_REGION_LIMITS_H_
