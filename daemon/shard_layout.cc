// ShardStart and ShardPieces: integer cuts of the concatenated regions; CheckReplicaGroup: the
// bounds of a trainer's declaration.
#include "daemon/shard_layout.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moesnap::daemon {

uint64_t ShardStart(uint64_t total, uint32_t members, uint32_t index) {
  if (index >= members) return total;
  // floor(total * index / members) without overflow: with total = q * members + r, it is
  // q * index + floor(r * index / members), and r * index < members^2 fits in 64 bits.
  const uint64_t exact = total / members * index + total % members * index / members;
  return exact / kShardAlignment * kShardAlignment;
}

std::vector<ShardPiece> ShardPieces(const std::vector<uint64_t>& region_bytes, uint32_t members,
                                    uint32_t index) {
  // Registered regions are mapped memory: their sum fits in 64 bits (saturating all the same).
  uint64_t sum = 0;
  for (uint64_t bytes : region_bytes) sum += std::min(bytes, UINT64_MAX - sum);
  const uint64_t begin = ShardStart(sum, members, index);
  const uint64_t end = ShardStart(sum, members, index + 1);
  std::vector<ShardPiece> pieces;
  pieces.reserve(region_bytes.size());
  uint64_t start = 0;  // of the region in the concatenation
  for (uint64_t bytes : region_bytes) {
    const uint64_t region_end = start + std::min(bytes, UINT64_MAX - start);
    const uint64_t from = std::max(begin, start);
    const uint64_t to = std::min(end, region_end);
    pieces.push_back(from < to ? ShardPiece{from - start, to - from} : ShardPiece{});
    start = region_end;
  }
  return pieces;
}

absl::Status CheckReplicaGroup(uint32_t rank, const std::string& region,
                               const v1::ReplicaGroup& group) {
  const auto where = [&] { return absl::StrCat("region '", region, "' of rank ", rank); };
  if (group.name().empty() || group.name().size() > kMaxReplicaGroupNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), ": a replica group needs a name of 1 to ", kMaxReplicaGroupNameBytes,
        " bytes, got ", group.name().size()));
  }
  if (group.ranks().empty() || static_cast<size_t>(group.ranks_size()) > kMaxReplicaGroupRanks) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": replica group '", group.name(),
                                                   "' has ", group.ranks_size(),
                                                   " ranks; 1 to ", kMaxReplicaGroupRanks,
                                                   " are accepted"));
  }
  std::set<uint32_t> seen;
  for (uint32_t member : group.ranks()) {
    if (!seen.insert(member).second) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": replica group '", group.name(),
                                                     "' lists rank ", member, " twice"));
    }
  }
  if (!seen.contains(rank)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where(), ": replica group '", group.name(), "' has ranks [",
        absl::StrJoin(group.ranks(), ", "), "], which do not include rank ", rank));
  }
  return absl::OkStatus();
}

uint32_t MemberIndex(uint32_t rank, const v1::ReplicaGroup& group) {
  const auto it = std::find(group.ranks().begin(), group.ranks().end(), rank);
  return static_cast<uint32_t>(it - group.ranks().begin());
}

bool SameMembers(const v1::ReplicaGroup& a, const v1::ReplicaGroup& b) {
  return a.name() == b.name() &&
         std::equal(a.ranks().begin(), a.ranks().end(), b.ranks().begin(), b.ranks().end());
}

}  // namespace moesnap::daemon
