// Assembling a region of a data-parallel replica group from its members' pieces (REFT): the
// check that the pieces restored (from this node's store, fetched from other nodes, or decoded
// from a lost node's parity) are of one step and cover the region exactly once, and the fetch of
// the pieces this node does not hold. Every piece fetched is untrusted: it must be a piece of the
// group, of the step and size of the others, at a place no other piece covers.
#ifndef MOESNAP_DAEMON_GROUP_PIECES_H_
#define MOESNAP_DAEMON_GROUP_PIECES_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

// One member's piece of a region: `bytes` bytes of the region's `region_bytes` from `offset`.
struct GroupPiece {
  uint32_t member = 0;
  int64_t step = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t region_bytes = 0;
};

// A region of a replica group being restored into a rank: the pieces written so far and the
// members whose pieces another node holds.
struct GroupRegion {
  std::string region;
  v1::ReplicaGroupStep layout;  // the committed layout the rank restores from
  std::vector<GroupPiece> pieces;
  std::vector<uint32_t> remote_members;
};

// The step of `pieces` (any order) when they are of one step and one region size and cover
// [0, region size) exactly once; FAILED_PRECONDITION for mixed steps or sizes, DATA_LOSS for a gap
// or an overlap.
absl::StatusOr<int64_t> CheckGroupCover(const std::string& region, const v1::ReplicaGroupStep& layout,
                             std::vector<GroupPiece> pieces);

// Restores rank `member`'s pieces of `regions` into the rank (the elastic-restore path: from the
// node holding the member, or decoded from that node's group when it is lost); what it wrote.
using FetchPieces = std::function<absl::StatusOr<v1::RestoreResponse>(
    uint32_t member, const std::vector<std::string>& regions)>;

// Fetches every remote member's pieces of `regions` (one fetch per member) and checks each
// region's cover with the pieces already written; then sets each region's step in `response`.
// NOT_FOUND from a fetch means the member holds none of the regions asked for (a small state
// leaves some members nothing): the cover check then says whether that was right.
absl::Status FetchRemotePieces(const std::vector<GroupRegion>& regions, const FetchPieces& fetch,
                               v1::RestoreResponse* response);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_GROUP_PIECES_H_
