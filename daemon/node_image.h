// A node's snapshot of one step seen as one byte string, the unit the erasure layer codes: the
// node's regions in (rank, region) order, back to back (v1::NodeImage is its manifest). The bytes
// stay where the store keeps them, one pool extent per region; this view reads and writes across
// region boundaries and keeps the regions' pool bytes alive while it exists.
#ifndef MOESNAP_DAEMON_NODE_IMAGE_H_
#define MOESNAP_DAEMON_NODE_IMAGE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "daemon/pool.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

class NodeImage {
 public:
  NodeImage() = default;
  // `stored[i]` holds region i of `manifest` (at least its bytes).
  NodeImage(v1::NodeImage manifest, std::vector<std::shared_ptr<PoolBytes>> stored);

  // Allocates pool bytes per region of `manifest`, for a rebuild to fill.
  static absl::StatusOr<NodeImage> Allocate(Pool* pool, const v1::NodeImage& manifest);

  const v1::NodeImage& manifest() const { return manifest_; }
  const std::vector<std::shared_ptr<PoolBytes>>& stored() const { return stored_; }
  uint64_t bytes() const { return manifest_.bytes(); }

  // Copies image bytes [offset, offset + length) to `out`; bytes past the end of the image are zero.
  void Read(uint64_t offset, uint64_t length, uint8_t* out) const;
  // Writes to `out` this image's bytes [offset, offset + length) XOR `other`'s, each read as Read
  // does (zero past its end): a unit's delta against another image, in one pass.
  void XorWith(const NodeImage& other, uint64_t offset, uint64_t length, uint8_t* out) const;
  // The pool memory holding image bytes [offset, offset + length), in order, pieces adjacent in
  // memory merged: to send them without a copy. The range must lie within the image.
  std::vector<absl::Span<const uint8_t>> Spans(uint64_t offset, uint64_t length) const;
  // Writes `length` bytes at `offset`; they must lie within the image.
  void Write(uint64_t offset, const uint8_t* in, uint64_t length) const;
  // The pool memory of image bytes [offset, offset + length) when they lie in one piece of one
  // region, else null: for a rebuild to receive a unit straight into its new image. The range must
  // lie within the image.
  uint8_t* Contiguous(uint64_t offset, uint64_t length) const;

  // Chunks whose CRC-32C differs from the manifest's, as (region index, chunk) pairs.
  std::vector<std::pair<int, uint32_t>> CorruptChunks() const;
  // Image byte range of chunk `chunk` of region `region`.
  std::pair<uint64_t, uint64_t> ChunkRange(int region, uint32_t chunk) const;

 private:
  // Visits the pieces of [offset, offset + length) that lie in regions: (region, offset in region,
  // offset in the range, length).
  template <typename Visit>
  void ForEachPiece(uint64_t offset, uint64_t length, Visit visit) const;
  // Visits the pool memory holding those pieces, in order: (data, length, offset in the range).
  template <typename Visit>
  void ForEachSpan(uint64_t offset, uint64_t length, Visit visit) const;

  v1::NodeImage manifest_;
  std::vector<std::shared_ptr<PoolBytes>> stored_;
  std::vector<uint64_t> starts_;  // image offset of each region
};

// True when both images hold the same regions (rank, name, size) in the same order, so that every
// image offset means the same bytes of the same region in both.
bool SameLayout(const v1::NodeImage& before, const v1::NodeImage& after);
// For two images of the same layout: which units of `unit_bytes` hold a region whose version
// differs (captured again since `before`).
std::vector<bool> ChangedUnits(const v1::NodeImage& before, const v1::NodeImage& after,
                               uint64_t unit_bytes);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_NODE_IMAGE_H_
