// Image patches: changed regions by position, and the CRC of the whole image they build.
#include "daemon/cluster/image_patch.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <array>
#include <string_view>
#include <utility>

#include "absl/functional/function_ref.h"
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

// Hands the serializer one buffer after another and each filled one to `consume`, so that a
// serialization is consumed in pieces that are still in cache.
class PieceStream final : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  explicit PieceStream(absl::FunctionRef<void(std::string_view)> consume) : consume_(consume) {}

  bool Next(void** data, int* size) override {
    Pass();
    *data = buffer_.data();
    *size = static_cast<int>(buffer_.size());
    filled_ = buffer_.size();
    return true;
  }
  void BackUp(int count) override { filled_ -= static_cast<size_t>(count); }
  int64_t ByteCount() const override { return static_cast<int64_t>(passed_ + filled_); }

  // Consumes what the serializer wrote in the current buffer.
  void Pass() {
    if (filled_ == 0) return;
    consume_(std::string_view(buffer_.data(), filled_));
    passed_ += filled_;
    filled_ = 0;
  }

 private:
  absl::FunctionRef<void(std::string_view)> consume_;
  std::array<char, 16 << 10> buffer_;
  size_t filled_ = 0;  // of buffer_, not yet consumed
  uint64_t passed_ = 0;
};

// Writes `image` to `stream` deterministically: the one serialization ImageBytes and ImageCrc
// both take. On return the stream holds all of it (the coded stream, destroyed,
// has handed back what it did not fill).
void SerializeDeterministically(const v1::NodeImage& image,
                                google::protobuf::io::ZeroCopyOutputStream* stream) {
  google::protobuf::io::CodedOutputStream coded(stream);
  coded.SetSerializationDeterministic(true);
  image.SerializeToCodedStream(&coded);
}

// ImageBytes(image), consumed in pieces.
void SerializeInPieces(const v1::NodeImage& image,
                       absl::FunctionRef<void(std::string_view)> consume) {
  PieceStream stream(consume);
  SerializeDeterministically(image, &stream);
  stream.Pass();
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
  SerializeDeterministically(image, &stream);
}

uint32_t ImageCrc(const v1::NodeImage& image) {
  uint32_t crc = 0;
  SerializeInPieces(image, [&](std::string_view piece) {
    crc = erasure::Crc32cExtend(crc, piece.data(), piece.size());
  });
  return crc;
}

std::optional<ImagePatchOf> PatchOf(const v1::NodeImage& base, const v1::NodeImage& image,
                                    uint32_t image_crc) {
  if (base.node_id() != image.node_id() || base.regions_size() != image.regions_size()) {
    return std::nullopt;
  }
  ImagePatchOf of;
  of.patch.set_node_id(image.node_id());
  of.patch.set_image_crc(image_crc);
  of.changes.set_node_id(image.node_id());
  of.changes.set_step(image.step());
  of.changes.set_bytes(image.bytes());
  *of.changes.mutable_ranks() = image.ranks();
  for (int position = 0; position < image.regions_size(); ++position) {
    if (SameEntry(base.regions(position), image.regions(position))) continue;
    // A receiver copies the base image and then the changes: past half the regions, sending the
    // image whole costs it less.
    if (2 * (of.patch.changed_size() + 1) > image.regions_size()) return std::nullopt;
    of.patch.add_changed(static_cast<uint32_t>(position));
    *of.changes.add_regions() = image.regions(position);
  }
  return of;
}

absl::StatusOr<v1::NodeImage> PatchedImage(const v1::NodeImage& base,
                                           const v1::NodeImage& changes,
                                           const v1::ImagePatch& patch, std::string& bytes,
                                           v1::NodeImage memory) {
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
  v1::NodeImage image = std::move(memory);
  image.CopyFrom(base);
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
  ImageBytesInto(image, bytes);
  if (const uint32_t crc = erasure::Crc32c(bytes.data(), bytes.size()); crc != patch.image_crc()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the image of node ", patch.node_id(), " built from its patch on this node's record of ",
        "the base step has CRC ", crc, ", the coordinator's ", patch.image_crc(),
        ": the record or the patch is not the coordinator's"));
  }
  return image;
}

}  // namespace moesnap::daemon::cluster
