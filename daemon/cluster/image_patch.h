// Image patches: a member's image of a step sent as the regions it changed since the base step.
// Every member of a group holds the same record of the base step, so an Encode request need not
// carry every member's whole image: the coordinator sends each member's changed regions and the
// CRC of the whole image, and each receiver builds the image from its record and checks the CRC.
// A sparse step of a rank with thousands of tensors then sends, parses and frees its changed
// entries only.
#ifndef MOESNAP_DAEMON_CLUSTER_IMAGE_PATCH_H_
#define MOESNAP_DAEMON_CLUSTER_IMAGE_PATCH_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

// `image` serialized deterministically: NodeImage has no map fields, so two images are equal
// field for field exactly when these bytes are, and comparing them is one pass over memory.
std::string ImageBytes(const v1::NodeImage& image);
// The same, written into `bytes` (its contents go; its capacity is kept).
void ImageBytesInto(const v1::NodeImage& image, std::string& bytes);

// `image` made a copy of `from`, field for field, in its own memory: an entry already equal to
// `from`'s at its position (and carrying no field this build does not know) is kept as it is, so
// memory that holds a neighbouring step's image of the node costs a comparison per region where a
// copy would rewrite every one. Returns whether `from` carries fields this build does not know (on
// top or in an entry), read from each entry as it is compared.
bool AssignImage(const v1::NodeImage& from, v1::NodeImage& image);

// Memory to build an image in: an image whose allocations are reused (its contents go), and what
// is known of how it stands to the image copied into it.
struct ImageMemory {
  v1::NodeImage image;
  // Set when the image copied into it is known to be `image`, entry for entry, but at the regions
  // at these positions (ascending) and in its fields on top, and to carry no field this build
  // does not know: it was built on `image` by changing those regions (a patch's, or none for an
  // absent member's copy), and neither changed since.
  std::optional<std::vector<uint32_t>> differs_at = std::nullopt;
};

// AssignImage into `memory.image`. With `memory.differs_at` the copy writes those regions and the
// fields on top alone, and takes `from` to carry no field this build does not know (returning
// false): nothing else of either image is read. Without it, or when it does not fit the two
// images (a position out of order or beyond them, another number of regions, unknown fields on
// top), every entry is compared as AssignImage compares them.
bool AssignImage(const v1::NodeImage& from, ImageMemory& memory);

// What the coordinator sends of a member's image.
struct ImagePatchOf {
  v1::ImagePatch patch;
  v1::NodeImage changes;  // node id, step, bytes, ranks, and the changed regions in patch order
};

// `image` as its changes since `base` (the same node's image in the base step's record); none when
// the two do not list the same number of regions (a rank registered or dropped regions) or more
// than half of them changed (a dense step), so the image goes whole.
// With a patch, `bytes` receives the image's bytes, over which the patch's CRC is taken: given
// `base_bytes`, the bytes `base` came as (the record's, or as its proposer sent them), they are
// spliced from the base's unchanged entries where they lie out as ImageBytes(base) does and
// neither image carries fields this build does not know, and are ImageBytes(image) otherwise;
// every holder of the same base bytes makes the same bytes, and from ImageBytes(base) a splice
// gives ImageBytes(image). Without a patch, `bytes` is left as it was: the caller sends the
// image as the bytes it has of it, or serializes it.
std::optional<ImagePatchOf> PatchOf(const v1::NodeImage& base, std::string_view base_bytes,
                                    const v1::NodeImage& image, std::string& bytes);

// The image `patch` and `changes` describe, built on `base` (the receiver's record of the node at
// the base step). INVALID_ARGUMENT when they do not fit `base` (another node's, positions out of
// order or beyond its regions); FAILED_PRECONDITION when the image built has another CRC than the
// coordinator's: the receiver's record of the base step is not the coordinator's (or the patch
// was altered).
// The image is built in `memory` (its base copied in as AssignImage copies it), and `bytes`
// receives its bytes, made as PatchOf makes them, over which the CRC is taken: a caller that keeps
// the image keeps its serialization too (the journal writes it) without serializing it again.
// Given `base_bytes`, the bytes `base` came as, they are spliced from its unchanged entries and
// the changed ones: a copy instead of a serialization of every region.
// `unknown_fields`, when given, is set to whether the image built carries fields this build does
// not know (its base's, or its changes').
absl::StatusOr<v1::NodeImage> PatchedImage(const v1::NodeImage& base, std::string_view base_bytes,
                                           const v1::NodeImage& changes,
                                           const v1::ImagePatch& patch, std::string& bytes,
                                           ImageMemory memory = {},
                                           bool* unknown_fields = nullptr);

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_IMAGE_PATCH_H_
