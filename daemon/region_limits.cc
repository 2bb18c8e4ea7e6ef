// CheckRegionSpec and CheckStoredRegion: each field against its bound; a name too long to print is
// cut in the message.
#include "daemon/region_limits.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/shard_layout.h"

namespace moesnap::daemon {
namespace {

// JournalVersion and ImageRegion carry the same fields under the same names.
template <typename Record>
absl::Status CheckStored(const Record& record) {
  const auto invalid = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (record.region().empty() || record.region().size() > kMaxRegionNameBytes) {
    return invalid(absl::StrCat("its name is ", record.region().size(), " bytes, not 1 to ",
                                kMaxRegionNameBytes));
  }
  if (record.dtype().size() > kMaxDtypeBytes) {
    return invalid(absl::StrCat("its dtype is ", record.dtype().size(), " bytes, above ",
                                kMaxDtypeBytes));
  }
  if (record.shape_size() > kMaxShapeDimensions) {
    return invalid(absl::StrCat("its shape has ", record.shape_size(), " dimensions, above ",
                                kMaxShapeDimensions));
  }
  for (int dimension = 0; dimension < record.shape_size(); ++dimension) {
    if (record.shape(dimension) < 0) {
      return invalid(absl::StrCat("its dimension ", dimension, " is ", record.shape(dimension)));
    }
  }
  if (record.bytes() == 0) {
    if (record.chunk_crcs_size() != 0) return invalid("it is empty but lists chunk CRCs");
  } else {
    if (record.chunk_bytes() == 0) return invalid("its chunk size is 0");
    const uint64_t chunks =
        record.bytes() / record.chunk_bytes() + (record.bytes() % record.chunk_bytes() != 0);
    if (static_cast<uint64_t>(record.chunk_crcs_size()) != chunks) {
      return invalid(absl::StrCat("it is ", record.bytes(), " bytes in chunks of ",
                                  record.chunk_bytes(), " (", chunks, " chunks), but lists ",
                                  record.chunk_crcs_size(), " chunk CRCs"));
    }
  }
  if (record.has_piece()) {
    const v1::RegionPiece& piece = record.piece();
    // A piece of no group would be taken for the whole region, and copied at its offset.
    if (piece.replica_group().empty() || piece.replica_group().size() > kMaxReplicaGroupNameBytes) {
      return invalid(absl::StrCat(
          "its piece names no replica group (a name of ", piece.replica_group().size(),
          " bytes, not 1 to ", kMaxReplicaGroupNameBytes, ")"));
    }
    if (piece.offset() > piece.region_bytes() ||
        record.bytes() > piece.region_bytes() - piece.offset()) {
      return invalid(absl::StrCat("its piece of replica group '", piece.replica_group(), "' is ",
                                  record.bytes(), " bytes from byte ", piece.offset(),
                                  ", past the region's end at ", piece.region_bytes()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckRegionSpec(const v1::RegionSpec& spec) {
  if (spec.name().empty()) return absl::InvalidArgumentError("a region needs a name");
  if (spec.name().size() > kMaxRegionNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region '", spec.name().substr(0, 64), "...' has a name of ", spec.name().size(),
        " bytes; at most ", kMaxRegionNameBytes, " are accepted"));
  }
  if (spec.dtype().size() > kMaxDtypeBytes) {
    return absl::InvalidArgumentError(absl::StrCat("region '", spec.name(), "' has a dtype of ",
                                                   spec.dtype().size(), " bytes; at most ",
                                                   kMaxDtypeBytes, " are accepted"));
  }
  if (spec.shape_size() > kMaxShapeDimensions) {
    return absl::InvalidArgumentError(absl::StrCat("region '", spec.name(), "' has ",
                                                   spec.shape_size(), " dimensions; at most ",
                                                   kMaxShapeDimensions, " are accepted"));
  }
  if (spec.bytes() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("region '", spec.name(), "' has 0 bytes"));
  }
  return absl::OkStatus();
}

absl::Status CheckStoredRegion(const v1::JournalVersion& record) { return CheckStored(record); }
absl::Status CheckStoredRegion(const v1::ImageRegion& record) { return CheckStored(record); }

}  // namespace moesnap::daemon
