// How the regions a replica group holds (data-parallel replicas with identical copies) are cut into
// one shard per member, so that each member captures a distinct 1/N of them (REFT). The layout is a
// pure function of the regions' sizes in name order and the number of members: every member, and
// any later reader, computes the same cuts.
#ifndef MOESNAP_DAEMON_SHARD_LAYOUT_H_
#define MOESNAP_DAEMON_SHARD_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

// Shard boundaries fall on multiples of this many bytes of the concatenated regions (the last at
// their end), so that copies stay page-aligned; shards differ in size by at most one unit.
inline constexpr uint64_t kShardAlignment = 4096;
inline constexpr size_t kMaxReplicaGroupRanks = 4096;
inline constexpr size_t kMaxReplicaGroupNameBytes = 256;

// The part of one region that one member captures: `bytes` bytes from `offset` (0 bytes: none).
struct ShardPiece {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  bool operator==(const ShardPiece&) const = default;
};

// Where shard `index` of `members` starts in `total` bytes: index * total / members rounded down to
// kShardAlignment; shard `members` starts at `total`. Requires index <= members, members >= 1.
uint64_t ShardStart(uint64_t total, uint32_t members, uint32_t index);

// Member `index`'s piece of each region, the regions given by their sizes in name order and laid
// end to end. Requires index < members. A region may span several shards; one smaller than a
// shard lies in one or two of them. With one member, each piece is the whole region.
std::vector<ShardPiece> ShardPieces(const std::vector<uint64_t>& region_bytes, uint32_t members,
                                    uint32_t index);

// INVALID_ARGUMENT naming what is wrong with a region's replica group as declared by `rank`: an
// empty or too long name, no members or more than kMaxReplicaGroupRanks, a rank listed twice, or
// `rank` not among them.
absl::Status CheckReplicaGroup(uint32_t rank, const std::string& region,
                               const v1::ReplicaGroup& group);

// This rank's position in the group (CheckReplicaGroup passed).
uint32_t MemberIndex(uint32_t rank, const v1::ReplicaGroup& group);

bool SameMembers(const v1::ReplicaGroup& a, const v1::ReplicaGroup& b);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_SHARD_LAYOUT_H_
