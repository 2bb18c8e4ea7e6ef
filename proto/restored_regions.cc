// The columns of a restore's regions (proto/restored_regions.h): appended to, and read back only
// once every column agrees with the others, bounds checked without overflow.
#include "proto/restored_regions.h"

#include <cstddef>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moesnap {

void ReserveRestored(v1::RestoredRegions& restored, int count) {
  restored.mutable_name_lengths()->Reserve(count);
  restored.mutable_steps()->Reserve(count);
  restored.mutable_bytes()->Reserve(count);
}

void AddRestored(v1::RestoredRegions& restored, std::string_view name, int64_t step, uint64_t bytes,
                 const v1::RegionPiece* piece) {
  if (piece != nullptr) {
    (*restored.mutable_pieces())[static_cast<uint32_t>(restored.steps_size())] = *piece;
  }
  restored.mutable_names()->append(name);
  restored.add_name_lengths(static_cast<uint32_t>(name.size()));
  restored.add_steps(step);
  restored.add_bytes(bytes);
}

absl::StatusOr<std::vector<RestoredRegionView>> ReadRestored(const v1::RestoredRegions& restored) {
  const int count = restored.name_lengths_size();
  if (restored.steps_size() != count || restored.bytes_size() != count) {
    return absl::DataLossError(absl::StrCat(
        "the restored regions disagree: ", count, " names, ", restored.steps_size(), " steps, ",
        restored.bytes_size(), " sizes"));
  }
  const std::string_view names = restored.names();
  std::vector<RestoredRegionView> regions;
  regions.reserve(count);
  size_t offset = 0;
  for (int i = 0; i < count; ++i) {
    const size_t length = restored.name_lengths(i);
    if (length > names.size() - offset) {
      return absl::DataLossError(absl::StrCat("the restored regions' names end after ",
                                              names.size(), " bytes, inside the name of region ",
                                              i, " (", length, " bytes from byte ", offset, ")"));
    }
    regions.push_back({names.substr(offset, length), restored.steps(i), restored.bytes(i)});
    offset += length;
  }
  if (offset != names.size()) {
    return absl::DataLossError(absl::StrCat("the restored regions' names are ", names.size(),
                                            " bytes, but their lengths add up to ", offset));
  }
  for (const auto& [index, piece] : restored.pieces()) {
    if (index >= static_cast<uint32_t>(count)) {
      return absl::DataLossError(absl::StrCat("a piece is given for region ", index, " of the ",
                                              count, " restored"));
    }
    regions[index].piece = &piece;
  }
  return regions;
}

absl::StatusOr<std::vector<RestoredRegionView>> ReadRestored(const v1::RestoreResponse& response) {
  if (!response.has_restored()) {
    return absl::FailedPreconditionError(
        "the restore's answer lists no regions in the form this release reads (RestoredRegions): "
        "the daemon that answered is of an older release; trainers' libraries and daemons are "
        "upgraded together");
  }
  return ReadRestored(response.restored());
}

}  // namespace moesnap
