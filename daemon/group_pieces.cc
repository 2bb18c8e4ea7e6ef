// Replica-group pieces: the cover check, and the fetch of the pieces held by other nodes.
#include "daemon/group_pieces.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/restored_regions.h"

namespace moesnap::daemon {
namespace {

std::string Where(const std::string& region, const v1::ReplicaGroupStep& layout) {
  return absl::StrCat("region '", region, "' of replica group '", layout.group().name(),
                      "' (ranks [", absl::StrJoin(layout.group().ranks(), ", "), "] at step ",
                      layout.step(), ")");
}

}  // namespace

absl::StatusOr<int64_t> CheckGroupCover(const std::string& region,
                                        const v1::ReplicaGroupStep& layout,
                                        std::vector<GroupPiece> pieces) {
  std::sort(pieces.begin(), pieces.end(),
            [](const GroupPiece& a, const GroupPiece& b) { return a.offset < b.offset; });
  if (pieces.empty()) {
    return absl::DataLossError(
        absl::StrCat(Where(region, layout), ": no member holds a piece of it"));
  }
  const GroupPiece& first = pieces.front();
  uint64_t covered = 0;
  for (const GroupPiece& piece : pieces) {
    if (piece.step != first.step || piece.region_bytes != first.region_bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          Where(region, layout), ": rank ", first.member, " holds a piece of ", first.region_bytes,
          " bytes at step ", first.step, ", rank ", piece.member, " one of ", piece.region_bytes,
          " bytes at step ", piece.step));
    }
    // covered <= region_bytes holds here, so the subtraction cannot wrap.
    if (piece.offset != covered || piece.bytes > piece.region_bytes - covered) {
      return absl::DataLossError(absl::StrCat(
          Where(region, layout), ": the pieces cover bytes [0, ", covered, "), then rank ",
          piece.member, " holds ", piece.bytes, " bytes from ", piece.offset));
    }
    covered += piece.bytes;
  }
  if (covered != first.region_bytes) {
    return absl::DataLossError(absl::StrCat(Where(region, layout), ": the members' pieces cover ",
                                            covered, " bytes of ", first.region_bytes));
  }
  return first.step;
}

absl::Status FetchRemotePieces(const std::vector<GroupRegion>& regions, const FetchPieces& fetch,
                               v1::RestoreResponse* response) {
  std::map<std::string, const GroupRegion*> by_name;
  std::map<std::string, std::vector<GroupPiece>> pieces;
  std::map<uint32_t, std::vector<std::string>> asked;  // member -> its regions to fetch
  for (const GroupRegion& region : regions) {
    by_name[region.region] = &region;
    pieces[region.region] = region.pieces;
    for (uint32_t member : region.remote_members) asked[member].push_back(region.region);
  }
  std::vector<std::string> empty_handed;  // members that held none of the regions asked for
  for (const auto& [member, names] : asked) {
    absl::StatusOr<v1::RestoreResponse> fetched = fetch(member, names);
    if (absl::IsNotFound(fetched.status())) {
      empty_handed.push_back(absl::StrCat("rank ", member, " (", fetched.status().message(), ")"));
      continue;
    }
    if (!fetched.ok()) {
      return absl::Status(fetched.status().code(),
                          absl::StrCat("the shard of replica-group member rank ", member,
                                       ", on another node: ", fetched.status().message()));
    }
    absl::StatusOr<std::vector<RestoredRegionView>> restored = ReadRestored(*fetched);
    if (!restored.ok()) {
      return absl::DataLossError(absl::StrCat("the restore of rank ", member, "'s shard: ",
                                              restored.status().message()));
    }
    for (const RestoredRegionView& held : *restored) {
      const std::string name(held.name);
      auto region = by_name.find(name);
      // Asked of this member: the member is one of the region's remote members (a few per group,
      // where the names asked of it may be thousands).
      if (region == by_name.end() ||
          std::find(region->second->remote_members.begin(), region->second->remote_members.end(),
                    member) == region->second->remote_members.end()) {
        return absl::DataLossError(absl::StrCat("the restore of rank ", member,
                                                "'s shard gave region '", name,
                                                "', which was not asked of it"));
      }
      const v1::ReplicaGroup& group = region->second->layout.group();
      if (held.piece == nullptr || held.piece->replica_group() != group.name()) {
        return absl::DataLossError(absl::StrCat("rank ", member, "'s committed region '", name,
                                                "' is not a piece of replica group '",
                                                group.name(), "'"));
      }
      pieces[name].push_back(
          {member, held.step, held.piece->offset(), held.bytes, held.piece->region_bytes()});
    }
  }
  std::map<std::string, int64_t> steps;
  for (const GroupRegion& region : regions) {
    absl::StatusOr<int64_t> step =
        CheckGroupCover(region.region, region.layout, pieces[region.region]);
    if (!step.ok()) {
      if (empty_handed.empty()) return step.status();
      return absl::Status(step.status().code(),
                          absl::StrCat(step.status().message(), "; held nothing asked for: ",
                                       absl::StrJoin(empty_handed, ", ")));
    }
    steps[region.region] = *step;
  }
  absl::StatusOr<std::vector<RestoredRegionView>> restored = ReadRestored(response->restored());
  if (!restored.ok()) return restored.status();
  for (size_t i = 0; i < restored->size(); ++i) {
    if (auto step = steps.find(std::string((*restored)[i].name)); step != steps.end()) {
      response->mutable_restored()->set_steps(static_cast<int>(i), step->second);
    }
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon
