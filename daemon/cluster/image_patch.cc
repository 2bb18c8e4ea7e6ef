// Image patches: changed regions by position, and the CRC of the whole image they build.
#include "daemon/cluster/image_patch.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <cassert>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon::cluster {
namespace {

bool SamePiece(const v1::ImageRegion& a, const v1::ImageRegion& b) {
  if (a.has_piece() != b.has_piece()) return false;
  if (!a.has_piece()) return true;
  return a.piece().replica_group() == b.piece().replica_group() &&
         a.piece().offset() == b.piece().offset() &&
         a.piece().region_bytes() == b.piece().region_bytes();
}

// Field for field; image_patch_test fails when ImageRegion gains a field this does not compare.
bool SameEntry(const v1::ImageRegion& a, const v1::ImageRegion& b) {
  return a.rank() == b.rank() && a.step() == b.step() && a.bytes() == b.bytes() &&
         a.chunk_bytes() == b.chunk_bytes() && a.region() == b.region() && a.dtype() == b.dtype() &&
         std::equal(a.shape().begin(), a.shape().end(), b.shape().begin(), b.shape().end()) &&
         std::equal(a.chunk_crcs().begin(), a.chunk_crcs().end(), b.chunk_crcs().begin(),
                    b.chunk_crcs().end()) &&
         SamePiece(a, b);
}

// Whether `positions` ascend, each below `regions`.
bool Ascending(const std::vector<uint32_t>& positions, int regions) {
  int64_t previous = -1;
  for (uint32_t position : positions) {
    if (static_cast<int64_t>(position) <= previous || position >= static_cast<uint32_t>(regions)) {
      return false;
    }
    previous = position;
  }
  return true;
}

// Wire types of the fields a NodeImage serializes.
constexpr uint32_t kVarint = 0;
constexpr uint32_t kLengthDelimited = 2;

// Where each region's entry (its tag and length first) lies in `bytes`, ImageBytes of an image of
// `regions` regions: none when the bytes do not lie out so (fields 1 to 3, then `regions` entries
// of field 4, then field 5 only).
std::optional<std::vector<std::pair<size_t, size_t>>> EntriesOf(std::string_view bytes,
                                                                int regions) {
  using google::protobuf::io::CodedInputStream;
  CodedInputStream input(reinterpret_cast<const uint8_t*>(bytes.data()),
                         static_cast<int>(bytes.size()));
  std::vector<std::pair<size_t, size_t>> entries;
  entries.reserve(regions);
  while (true) {
    const size_t start = static_cast<size_t>(input.CurrentPosition());
    const uint32_t tag = input.ReadTag();
    if (tag == 0) break;
    const uint32_t field = tag >> 3, wire = tag & 7;
    if (field < v1::NodeImage::kRegionsFieldNumber && wire == kVarint && entries.empty()) {
      uint64_t ignored;
      if (!input.ReadVarint64(&ignored)) return std::nullopt;
    } else if (field == v1::NodeImage::kRegionsFieldNumber && wire == kLengthDelimited) {
      uint32_t length;
      if (!input.ReadVarint32(&length) || !input.Skip(static_cast<int>(length))) return std::nullopt;
      entries.emplace_back(start, static_cast<size_t>(input.CurrentPosition()));
    } else if (field == v1::NodeImage::kRanksFieldNumber && wire == kLengthDelimited) {
      break;
    } else {
      return std::nullopt;
    }
  }
  if (static_cast<int>(entries.size()) != regions) return std::nullopt;
  return entries;
}

// Whether a region carries fields this build does not know: a spliced copy of such an entry's
// bytes is not what serializing an equal entry made here gives, and SameEntry does not see them.
// Each type's reflection is taken once: finding it costs more than the check of an entry.
class UnknownFieldsIn {
 public:
  bool operator()(const v1::ImageRegion& region) const {
    return !regions_.GetUnknownFields(region).empty() ||
           (region.has_piece() && !pieces_.GetUnknownFields(region.piece()).empty());
  }

 private:
  const google::protobuf::Reflection& regions_ = *v1::ImageRegion::GetReflection();
  const google::protobuf::Reflection& pieces_ = *v1::RegionPiece::GetReflection();
};

// Whether `image` carries fields this build does not know on top (not in its entries).
bool HasUnknownFieldsOnTop(const v1::NodeImage& image) {
  return !v1::NodeImage::GetReflection()->GetUnknownFields(image).empty();
}

// Appends `message` to `bytes`, serialized as ImageBytes serializes, as field `field` of the
// message holding it (its tag and length first) when given. Only the appended bytes are written,
// where a stream over the string would first fill all of its capacity with zeros.
void AppendSerialized(const google::protobuf::MessageLite& message, std::optional<int> field,
                      std::string& bytes) {
  using google::protobuf::io::CodedOutputStream;
  const size_t size = message.ByteSizeLong();
  if (field) {
    uint8_t header[10];  // a tag and a length, varints of 32 bits: 5 bytes each at most
    uint8_t* end = CodedOutputStream::WriteTagToArray(
        static_cast<uint32_t>(*field) << 3 | kLengthDelimited, header);
    end = CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(size), end);
    bytes.append(reinterpret_cast<const char*>(header), static_cast<size_t>(end - header));
  }
  const size_t at = bytes.size();
  bytes.resize(at + size);
  google::protobuf::io::ArrayOutputStream array(bytes.data() + at, static_cast<int>(size));
  CodedOutputStream coded(&array);
  coded.SetSerializationDeterministic(true);
  message.SerializeWithCachedSizes(&coded);
}

// PatchedImageBytes by splicing: false, with nothing promised of `bytes`, when it cannot.
bool SplicedBytes(const v1::NodeImage& base, std::string_view base_bytes,
                  const v1::NodeImage& image, const v1::ImagePatch& patch, std::string& bytes) {
  if (base.regions_size() == 0) return false;
  const std::optional<std::vector<std::pair<size_t, size_t>>> entries =
      EntriesOf(base_bytes, base.regions_size());
  if (!entries) return false;
  v1::NodeImage head;  // the fields before the regions
  head.set_node_id(image.node_id());
  head.set_step(image.step());
  head.set_bytes(image.bytes());
  v1::NodeImage tail;  // and after them
  *tail.mutable_ranks() = image.ranks();
  bytes.clear();
  bytes.reserve(base_bytes.size() + 64 * static_cast<size_t>(patch.changed_size()));
  AppendSerialized(head, std::nullopt, bytes);
  size_t copied = (*entries)[0].first;  // base entries are copied from here on
  for (uint32_t position : patch.changed()) {
    const auto [start, end] = (*entries)[position];
    bytes.append(base_bytes.data() + copied, start - copied);
    AppendSerialized(image.regions(static_cast<int>(position)), v1::NodeImage::kRegionsFieldNumber,
                     bytes);
    copied = end;
  }
  bytes.append(base_bytes.data() + copied, entries->back().second - copied);
  AppendSerialized(tail, std::nullopt, bytes);
  return true;
}

// The bytes of `image`, which is `base` with the regions `patch` names changed and its other
// fields set anew (PatchOf's image, or PatchedImage's): the unchanged entries' bytes are copied
// from `base_bytes`, the bytes `base` came as, and only the changed entries and the fields around
// them serialized. ImageBytes(image), serialized whole, when `base_bytes` do not lie out as
// ImageBytes(base) does, or are empty: the caller gives none when either image carries fields
// this build does not know (`base` in any entry, `image` in any of its changed entries too), for
// a splice of such an entry's bytes is not what serializing it here gives.
void PatchedImageBytes(const v1::NodeImage& base, std::string_view base_bytes,
                       const v1::NodeImage& image, const v1::ImagePatch& patch,
                       std::string& bytes) {
  if (base_bytes.empty() || !SplicedBytes(base, base_bytes, image, patch, bytes)) {
    ImageBytesInto(image, bytes);
  }
}

// PatchOf's patch, but for its CRC; `unknown_fields` is set when either image carries fields this
// build does not know (with a patch: none is spliced then).
std::optional<ImagePatchOf> ChangesOf(const v1::NodeImage& base, const v1::NodeImage& image,
                                      bool& unknown_fields) {
  if (base.node_id() != image.node_id() || base.regions_size() != image.regions_size()) {
    return std::nullopt;
  }
  const UnknownFieldsIn unknown_fields_in;
  unknown_fields = HasUnknownFieldsOnTop(base) || HasUnknownFieldsOnTop(image);
  ImagePatchOf of;
  of.patch.set_node_id(image.node_id());
  of.changes.set_node_id(image.node_id());
  of.changes.set_step(image.step());
  of.changes.set_bytes(image.bytes());
  *of.changes.mutable_ranks() = image.ranks();
  for (int position = 0; position < image.regions_size(); ++position) {
    const v1::ImageRegion& was = base.regions(position);
    const v1::ImageRegion& region = image.regions(position);
    // Read in the pass that compares them, while the entries are in cache.
    unknown_fields = unknown_fields || unknown_fields_in(was) || unknown_fields_in(region);
    if (SameEntry(was, region)) continue;
    // A receiver copies the base image and then the changes: past half the regions, sending the
    // image whole costs it less.
    if (2 * (of.patch.changed_size() + 1) > image.regions_size()) return std::nullopt;
    of.patch.add_changed(static_cast<uint32_t>(position));
  }
  // Copied once the image is known to go as a patch: a dense step's would be dropped.
  for (uint32_t position : of.patch.changed()) {
    *of.changes.add_regions() = image.regions(static_cast<int>(position));
  }
  return of;
}

}  // namespace

std::string ImageBytes(const v1::NodeImage& image) {
  std::string bytes;
  ImageBytesInto(image, bytes);
  return bytes;
}

void ImageBytesInto(const v1::NodeImage& image, std::string& bytes) {
  bytes.clear();
  google::protobuf::io::StringOutputStream stream(&bytes);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  image.SerializeToCodedStream(&coded);
}

bool AssignImage(const v1::NodeImage& from, v1::NodeImage& image) {
  if (HasUnknownFieldsOnTop(from) || HasUnknownFieldsOnTop(image)) {
    image.CopyFrom(from);
    return HasUnknownFieldsOnTop(from) ||
           std::any_of(from.regions().begin(), from.regions().end(), UnknownFieldsIn());
  }
  image.set_node_id(from.node_id());
  image.set_step(from.step());
  image.set_bytes(from.bytes());
  *image.mutable_ranks() = from.ranks();
  const UnknownFieldsIn unknown_fields_in;
  google::protobuf::RepeatedPtrField<v1::ImageRegion>& regions = *image.mutable_regions();
  while (regions.size() > from.regions_size()) regions.RemoveLast();  // kept for a later Add
  bool unknown_fields = false;
  for (int position = 0; position < from.regions_size(); ++position) {
    const v1::ImageRegion& entry = from.regions(position);
    const bool unknown = unknown_fields_in(entry);
    unknown_fields = unknown_fields || unknown;
    if (position == regions.size()) {
      regions.Add()->CopyFrom(entry);
    } else if (v1::ImageRegion& there = regions[position];
               unknown || !SameEntry(there, entry) || unknown_fields_in(there)) {
      there.CopyFrom(entry);
    }
  }
  return unknown_fields;
}

bool AssignImage(const v1::NodeImage& from, ImageMemory& memory) {
  v1::NodeImage& image = memory.image;
  const std::optional<std::vector<uint32_t>> differs_at = std::exchange(memory.differs_at, {});
  if (!differs_at || !Ascending(*differs_at, from.regions_size()) ||
      image.regions_size() != from.regions_size() || HasUnknownFieldsOnTop(from) ||
      HasUnknownFieldsOnTop(image)) {
    return AssignImage(from, image);
  }
  image.set_node_id(from.node_id());
  image.set_step(from.step());
  image.set_bytes(from.bytes());
  *image.mutable_ranks() = from.ranks();
  for (uint32_t position : *differs_at) {
    *image.mutable_regions(static_cast<int>(position)) = from.regions(static_cast<int>(position));
  }
  // A slip in the caller's bookkeeping of where the memory differs would pass every CRC (the
  // image's bytes are spliced from the base's, not serialized from it) and show only as larger
  // patches later: builds with assertions compare every entry.
  assert(std::equal(image.regions().begin(), image.regions().end(), from.regions().begin(),
                    from.regions().end(), SameEntry));
  return false;
}

std::optional<ImagePatchOf> PatchOf(const v1::NodeImage& base, std::string_view base_bytes,
                                    const v1::NodeImage& image, std::string& bytes) {
  bool unknown_fields = false;
  std::optional<ImagePatchOf> of = ChangesOf(base, image, unknown_fields);
  if (of) {
    // An image off the wire may carry fields this build does not know, which SameEntry does not
    // see and a splice of the base's entries would drop.
    PatchedImageBytes(base, unknown_fields ? std::string_view() : base_bytes, image, of->patch,
                      bytes);
    of->patch.set_image_crc(erasure::Crc32c(bytes.data(), bytes.size()));
  }
  return of;
}

absl::StatusOr<v1::NodeImage> PatchedImage(const v1::NodeImage& base, std::string_view base_bytes,
                                           const v1::NodeImage& changes,
                                           const v1::ImagePatch& patch, std::string& bytes,
                                           ImageMemory memory, bool* unknown_fields_out) {
  auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("the patch of node ", patch.node_id(), "'s image: ", what));
  };
  if (changes.node_id() != patch.node_id() || base.node_id() != patch.node_id()) {
    return invalid(absl::StrCat("it comes with node ", changes.node_id(),
                                "'s changes, on node ", base.node_id(), "'s image"));
  }
  if (changes.regions_size() != patch.changed_size()) {
    return invalid(absl::StrCat("it names ", patch.changed_size(), " changed regions and carries ",
                                changes.regions_size()));
  }
  // As PatchOf decides: the image's other entries are the base's.
  const bool unknown_fields =
      AssignImage(base, memory) ||
      std::any_of(changes.regions().begin(), changes.regions().end(), UnknownFieldsIn());
  if (unknown_fields_out != nullptr) *unknown_fields_out = unknown_fields;
  v1::NodeImage image = std::move(memory.image);
  image.set_step(changes.step());
  image.set_bytes(changes.bytes());
  *image.mutable_ranks() = changes.ranks();
  int64_t previous = -1;
  for (int i = 0; i < patch.changed_size(); ++i) {
    const uint32_t position = patch.changed(i);
    if (static_cast<int64_t>(position) <= previous ||
        position >= static_cast<uint32_t>(image.regions_size())) {
      return invalid(absl::StrCat("changed region ", position, " does not follow ", previous,
                                  " within the base image's ", image.regions_size(), " regions"));
    }
    *image.mutable_regions(static_cast<int>(position)) = changes.regions(i);
    previous = position;
  }
  PatchedImageBytes(base, unknown_fields ? std::string_view() : base_bytes, image, patch, bytes);
  if (const uint32_t crc = erasure::Crc32c(bytes.data(), bytes.size()); crc != patch.image_crc()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the image of node ", patch.node_id(), " built from its patch on this node's record of ",
        "the base step has CRC ", crc, ", the coordinator's ", patch.image_crc(),
        ": the record or the patch is not the coordinator's"));
  }
  return image;
}

}  // namespace moesnap::daemon::cluster
