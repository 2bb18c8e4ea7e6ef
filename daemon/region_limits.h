// Bounds on what a trainer may describe a region with. Every registration is kept in the journal,
// which all ranks of the node share: one rank's endless names must not fill it for everyone. And
// the checks of a stored version's record, whoever wrote it: every field a restore or a rebuild
// sizes a loop, an allocation or a copy by.
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

// A stored version of a region as a record carries it: a journal entry, a node image's region (a
// peer's, or a durable manifest's). INVALID_ARGUMENT saying what is wrong (its caller names the
// record) when its name, dtype or shape is past the bounds above or a dimension is negative, its
// chunk CRCs are not one per chunk (chunks of 0 bytes refused for a region of any bytes), or its
// piece of a replica group names none or does not lie within the region. A bound of the record's
// own (its bytes against an image, its chunk size against a file's reads) is its caller's.
absl::Status CheckStoredRegion(const v1::JournalVersion& record);
absl::Status CheckStoredRegion(const v1::ImageRegion& record);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_REGION_LIMITS_H_
