// A node's snapshot of one step seen as one byte string, the unit the erasure layer codes: the
// node's regions in (rank, region) order, back to back (v1::NodeImage is its manifest). The bytes
// stay where the store keeps them, one pool extent per region; this view reads and writes across
// region boundaries and keeps the regions' pool bytes alive while it exists.
#ifndef MOESNAP_DAEMON_NODE_IMAGE_H_
#define MOESNAP_DAEMON_NODE_IMAGE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include <google/protobuf/arena.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "daemon/pool.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

// Manifests handed back by the images built in them (NodeImage::BuiltIn) as those images go, for
// the next to be built in: a store builds a manifest of every region of the node each step, and
// one built over a neighbouring step's rewrites the entries that changed, where a manifest built
// afresh allocates, writes and frees every entry. Each memory comes with the key of each of its
// entries, which names what the entry was made from. Thread-safe.
class ManifestRecycler {
 public:
  struct Memory {
    std::unique_ptr<google::protobuf::Arena> arena;
    v1::NodeImage* manifest = nullptr;  // on `arena`
    std::vector<uint64_t> keys;         // per entry of `manifest`
    // What the arena held after the memory's first build: a rewrite that cannot reuse what an
    // entry held allocates anew, and what it leaves stays until the arena goes.
    uint64_t first_build_bytes = 0;
  };

  // The memory handed back last, if any is kept.
  std::optional<Memory> Take();
  // Keeps `memory`, and lets the oldest kept go beyond kKept. A memory whose arena grew past
  // twice what its first build took, and an arena block more (more entries, or rewrites that left
  // much unused behind), goes instead.
  void Keep(Memory memory);

 private:
  // A step's image is held until its decision, and the next is built meanwhile: two memories
  // serve that, and a third would be held memory nobody builds in.
  static constexpr size_t kKept = 2;

  absl::Mutex mutex_;
  std::deque<Memory> kept_ ABSL_GUARDED_BY(mutex_);
};

// The manifest lives on an arena the image owns: a store builds a manifest of every region of the
// node each step (thousands of entries of a few allocations each), and the arena allocates them in
// a few blocks and frees them at once with the image instead of entry by entry.
class NodeImage {
 public:
  NodeImage();
  // `stored[i]` holds region i of `manifest` (at least its bytes).
  NodeImage(const v1::NodeImage& manifest, std::vector<std::shared_ptr<PoolBytes>> stored);
  // An image whose manifest `build` writes in place, adding for each region it adds to the
  // manifest the pool bytes that hold it to `stored`. The manifest's `bytes` is then set to the
  // sum of its regions'.
  template <typename Build>
  static NodeImage Built(Build build) {
    NodeImage image;
    build(*image.memory_.manifest, image.stored_);
    image.MapRegions();
    return image;
  }
  // What a build in recycled memory writes: the manifest's fields on top, and its entries in
  // order, each under a key naming what it is made from, so that an entry the memory holds under
  // the same key at the same position is kept as it is.
  class Entries {
   public:
    // The manifest's fields on top (none set); its entries are Add's.
    v1::NodeImage& manifest() { return manifest_; }
    // Adds the next entry, its region held by `stored`: written by `write` (onto a cleared
    // entry) unless the memory's entry at its position was made under `key`. The caller keeps
    // each key to one content of an entry, for as long as the recycler lives.
    template <typename Write>
    void Add(uint64_t key, std::shared_ptr<PoolBytes> stored, Write write) {
      const int position = added_++;
      stored_.push_back(std::move(stored));
      if (position < manifest_.regions_size()) {
        if (keys_[position] == key) return;
        v1::ImageRegion& entry = *manifest_.mutable_regions(position);
        entry.Clear();
        write(entry);
      } else {
        write(*manifest_.add_regions());
        keys_.push_back(0);
      }
      keys_[position] = key;
    }

   private:
    friend class NodeImage;
    Entries(v1::NodeImage& manifest, std::vector<uint64_t>& keys,
            std::vector<std::shared_ptr<PoolBytes>>& stored)
        : manifest_(manifest), keys_(keys), stored_(stored) {}

    v1::NodeImage& manifest_;
    std::vector<uint64_t>& keys_;
    std::vector<std::shared_ptr<PoolBytes>>& stored_;
    int added_ = 0;
  };
  // An image built in memory `recycler` keeps (new memory when it keeps none) by `build`, which
  // is given the Entries to write; the memory goes back to `recycler` when the image goes. Its
  // manifest's `bytes` is then set to the sum of its regions'.
  template <typename Build>
  static NodeImage BuiltIn(std::shared_ptr<ManifestRecycler> recycler, Build build) {
    NodeImage image = InMemoryOf(std::move(recycler));
    ManifestRecycler::Memory& memory = image.memory_;
    image.stored_.reserve(static_cast<size_t>(memory.manifest->regions_size()));
    Entries entries(*memory.manifest, memory.keys, image.stored_);
    build(entries);
    image.KeepEntries(entries.added_);
    image.MapRegions();
    if (memory.first_build_bytes == 0) memory.first_build_bytes = memory.arena->SpaceAllocated();
    return image;
  }
  ~NodeImage();
  // A copy copies the manifest onto an arena of its own (and does not go back to a recycler); a
  // moved-from image holds no manifest.
  NodeImage(const NodeImage& other);
  NodeImage& operator=(const NodeImage& other);
  NodeImage(NodeImage&& other) noexcept;
  NodeImage& operator=(NodeImage&& other) noexcept;

  // Allocates pool bytes per region of `manifest`, for a rebuild to fill.
  static absl::StatusOr<NodeImage> Allocate(Pool* pool, const v1::NodeImage& manifest);

  const v1::NodeImage& manifest() const { return *memory_.manifest; }
  // Names the node the image is of (a store's image leaves it unset), in place of copying the
  // manifest to name it.
  void set_node_id(uint32_t node_id) { memory_.manifest->set_node_id(node_id); }
  const std::vector<std::shared_ptr<PoolBytes>>& stored() const { return stored_; }
  // The pool extents its regions' bytes lie in, all told: counted once as the image is made, for
  // the journal's bound (CommitJournalBound), which would otherwise reach each region's pool bytes
  // again when they are long out of cache.
  uint64_t pool_extents() const { return pool_extents_; }
  uint64_t bytes() const { return memory_.manifest->bytes(); }

  // Copies image bytes [offset, offset + length) to `out`; bytes past the end of the image are zero.
  void Read(uint64_t offset, uint64_t length, uint8_t* out) const;
  // Writes to `out` this image's bytes [offset, offset + length) XOR the same bytes at another
  // step of the same layout: `other[i]` holds region i then, as stored()[i] does now (what
  // ClusterStore::CommittedBytesOf gives). A unit's delta against the committed step, in one
  // pass, with no image of that step built. The range must lie within the image, and `other` hold
  // a region's bytes for each region of the range (RegionsIn).
  void XorWith(absl::Span<const std::shared_ptr<PoolBytes>> other, uint64_t offset,
               uint64_t length, uint8_t* out) const;
  // The positions of the regions holding image bytes [offset, offset + length), ascending.
  std::vector<int> RegionsIn(uint64_t offset, uint64_t length) const;
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

  // Sets starts_, pool_extents_ and the manifest's byte count from its regions.
  void MapRegions();
  // An image in `memory`, its fields on top cleared.
  explicit NodeImage(ManifestRecycler::Memory memory);
  // An empty image in memory `recycler` keeps, its fields on top cleared, its entries and their
  // keys as the memory holds them; in new memory when it keeps none.
  static NodeImage InMemoryOf(std::shared_ptr<ManifestRecycler> recycler);
  // Drops the entries past the first `count` (kept in the arena for a later build to reuse).
  void KeepEntries(int count);
  // Hands the manifest's memory back to the recycler it came from, if any.
  void Recycle();

  // The manifest, on the arena the image owns; its entries' keys and first build's size matter to
  // BuiltIn's images only. A moved-from image's manifest is null.
  ManifestRecycler::Memory memory_;
  std::shared_ptr<ManifestRecycler> recycler_;  // where memory_ goes back to, if anywhere
  std::vector<std::shared_ptr<PoolBytes>> stored_;
  std::vector<uint64_t> starts_;  // image offset of each region
  uint64_t pool_extents_ = 0;
};

// For two images of the same layout (the same regions: rank, name and size, in the same order, so
// that every image offset means the same bytes of the same region in both): which units of
// `unit_bytes` hold a region whose version differs (captured again since `before`); none when
// their layouts differ.
std::optional<std::vector<bool>> ChangedUnits(const v1::NodeImage& before,
                                              const v1::NodeImage& after, uint64_t unit_bytes);
// ChangedUnits of an `after` that is `before` but for its regions at `positions` (ascending), and
// whose `bytes` is the sum of its regions' (CheckNodeImage): only those regions are compared, and
// of the others only the sizes of those before the last are read. None when a region at
// `positions` changed its layout, or `positions` are not ascending within the images.
std::optional<std::vector<bool>> ChangedUnitsAt(const v1::NodeImage& before,
                                                const v1::NodeImage& after,
                                                absl::Span<const uint32_t> positions,
                                                uint64_t unit_bytes);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_NODE_IMAGE_H_
