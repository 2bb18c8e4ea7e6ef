// NodeImage: offsets of the image mapped onto the regions' pool bytes.
#include "daemon/node_image.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "erasure/crc32c.h"
#include "erasure/xor_bytes.h"

namespace moesnap::daemon {

namespace {

// Blocks of the manifest's arena: a manifest of a few regions takes one small block; one of
// thousands takes blocks of 64 KiB, below the size glibc maps and unmaps afresh each time.
constexpr uint64_t kManifestArenaMaxBlock = 64 << 10;
std::unique_ptr<google::protobuf::Arena> ManifestArena() {
  google::protobuf::ArenaOptions options;
  options.start_block_size = 1024;
  options.max_block_size = kManifestArenaMaxBlock;
  return std::make_unique<google::protobuf::Arena>(options);
}

// Whether two images' entries at one position lay out the same region: rank, name and size.
bool SameRegion(const v1::ImageRegion& a, const v1::ImageRegion& b) {
  return a.rank() == b.rank() && a.bytes() == b.bytes() && a.region() == b.region();
}

// Marks the units of `unit_bytes` that bytes [offset, offset + bytes) of an image lie in.
void MarkUnits(uint64_t offset, uint64_t bytes, uint64_t unit_bytes, std::vector<bool>& changed) {
  const uint64_t last = (offset + bytes - 1) / unit_bytes;
  if (changed.size() <= last) changed.resize(last + 1, false);
  for (uint64_t unit = offset / unit_bytes; unit <= last; ++unit) changed[unit] = true;
}

}  // namespace

NodeImage::NodeImage() {
  memory_.arena = ManifestArena();
  memory_.manifest = google::protobuf::Arena::CreateMessage<v1::NodeImage>(memory_.arena.get());
}

NodeImage::NodeImage(const v1::NodeImage& manifest, std::vector<std::shared_ptr<PoolBytes>> stored)
    : NodeImage() {
  memory_.manifest->CopyFrom(manifest);
  stored_ = std::move(stored);
  MapRegions();
}

NodeImage::NodeImage(const NodeImage& other) : NodeImage(*other.memory_.manifest, other.stored_) {}

NodeImage& NodeImage::operator=(const NodeImage& other) {
  if (this != &other) *this = NodeImage(other);
  return *this;
}

NodeImage::NodeImage(NodeImage&& other) noexcept
    : memory_(std::exchange(other.memory_, {})),
      recycler_(std::move(other.recycler_)),
      stored_(std::move(other.stored_)),
      starts_(std::move(other.starts_)),
      pool_extents_(other.pool_extents_) {}

NodeImage& NodeImage::operator=(NodeImage&& other) noexcept {
  if (this != &other) {
    // This image's manifest goes back to its recycler, or is freed with its arena, which the
    // other's replaces.
    Recycle();
    memory_ = std::exchange(other.memory_, {});
    recycler_ = std::move(other.recycler_);
    stored_ = std::move(other.stored_);
    starts_ = std::move(other.starts_);
    pool_extents_ = other.pool_extents_;
  }
  return *this;
}

NodeImage::~NodeImage() { Recycle(); }

void NodeImage::Recycle() {
  if (recycler_ == nullptr || memory_.manifest == nullptr) return;
  recycler_->Keep(std::exchange(memory_, {}));
  recycler_.reset();
}

NodeImage::NodeImage(ManifestRecycler::Memory memory)
    : memory_(std::move(memory)) {
  memory_.manifest->clear_node_id();
  memory_.manifest->clear_step();
  memory_.manifest->clear_bytes();
  memory_.manifest->clear_ranks();
}

NodeImage NodeImage::InMemoryOf(std::shared_ptr<ManifestRecycler> recycler) {
  std::optional<ManifestRecycler::Memory> memory = recycler->Take();
  NodeImage image = memory ? NodeImage(*std::move(memory)) : NodeImage();
  image.recycler_ = std::move(recycler);
  return image;
}

void NodeImage::KeepEntries(int count) {
  google::protobuf::RepeatedPtrField<v1::ImageRegion>& regions =
      *memory_.manifest->mutable_regions();
  while (regions.size() > count) regions.RemoveLast();
  memory_.keys.resize(static_cast<size_t>(count));
}

std::optional<ManifestRecycler::Memory> ManifestRecycler::Take() {
  absl::MutexLock lock(&mutex_);
  if (kept_.empty()) return std::nullopt;
  Memory memory = std::move(kept_.back());
  kept_.pop_back();
  return memory;
}

void ManifestRecycler::Keep(Memory memory) {
  // A block more: an arena grows by blocks, so a small manifest's next build may take one.
  if (memory.arena->SpaceAllocated() > 2 * memory.first_build_bytes + kManifestArenaMaxBlock) {
    return;
  }
  std::optional<Memory> oldest;  // freed once the lock is let go
  absl::MutexLock lock(&mutex_);
  kept_.push_back(std::move(memory));
  if (kept_.size() > kKept) {
    oldest = std::move(kept_.front());
    kept_.pop_front();
  }
}

void NodeImage::MapRegions() {
  starts_.clear();
  starts_.reserve(memory_.manifest->regions_size());
  uint64_t offset = 0;
  for (const v1::ImageRegion& region : memory_.manifest->regions()) {
    starts_.push_back(offset);
    offset += region.bytes();
  }
  memory_.manifest->set_bytes(offset);
  pool_extents_ = 0;
  for (const std::shared_ptr<PoolBytes>& stored : stored_) {
    if (stored != nullptr) pool_extents_ += stored->extents().size();
  }
}

absl::StatusOr<NodeImage> NodeImage::Allocate(Pool* pool, const v1::NodeImage& manifest) {
  std::vector<std::shared_ptr<PoolBytes>> stored;
  for (const v1::ImageRegion& region : manifest.regions()) {
    absl::StatusOr<std::shared_ptr<PoolBytes>> bytes = pool->AllocateBytes(region.bytes());
    if (!bytes.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no room for the ", manifest.bytes(), " bytes of node ", manifest.node_id(), "'s step ",
          manifest.step(), " (region '", region.region(), "' of rank ", region.rank(),
          "): ", bytes.status().message()));
    }
    stored.push_back(*std::move(bytes));
  }
  return NodeImage(manifest, std::move(stored));
}

template <typename Visit>
void NodeImage::ForEachPiece(uint64_t offset, uint64_t length, Visit visit) const {
  const uint64_t end = offset + length;
  // The first region that ends after `offset`.
  size_t i = std::upper_bound(starts_.begin(), starts_.end(), offset) - starts_.begin();
  i = i == 0 ? 0 : i - 1;
  for (; i < starts_.size() && starts_[i] < end; ++i) {
    const uint64_t region_end = starts_[i] + memory_.manifest->regions(static_cast<int>(i)).bytes();
    const uint64_t from = std::max(offset, starts_[i]);
    const uint64_t to = std::min(end, region_end);
    if (from < to) visit(static_cast<int>(i), from - starts_[i], from - offset, to - from);
  }
}

template <typename Visit>
void NodeImage::ForEachSpan(uint64_t offset, uint64_t length, Visit visit) const {
  ForEachPiece(offset, length,
               [&](int region, uint64_t in_region, uint64_t in_range, uint64_t bytes) {
                 stored_[region]->ForEach(
                     in_region, bytes, [&](const uint8_t* data, uint64_t piece, uint64_t position) {
                       visit(data, piece, in_range + position);
                     });
               });
}

void NodeImage::Read(uint64_t offset, uint64_t length, uint8_t* out) const {
  // Pieces come in order: only what no region covers (past the image's end) is zeroed.
  uint64_t filled = 0;
  ForEachPiece(offset, length,
               [&](int region, uint64_t in_region, uint64_t in_range, uint64_t bytes) {
                 std::memset(out + filled, 0, in_range - filled);
                 stored_[region]->Read(in_region, bytes, out + in_range);
                 filled = in_range + bytes;
               });
  std::memset(out + filled, 0, length - filled);
}

void NodeImage::XorWith(absl::Span<const std::shared_ptr<PoolBytes>> other, uint64_t offset,
                        uint64_t length, uint8_t* out) const {
  ForEachPiece(offset, length,
               [&](int region, uint64_t in_region, uint64_t in_range, uint64_t bytes) {
                 const PoolBytes& theirs = *other[region];
                 stored_[region]->ForEach(
                     in_region, bytes, [&](const uint8_t* mine, uint64_t piece, uint64_t at) {
                       theirs.ForEach(in_region + at, piece,
                                      [&](const uint8_t* data, uint64_t part, uint64_t within) {
                                        erasure::XorOf(out + in_range + at + within, mine + within,
                                                       data, part);
                                      });
                     });
               });
}

std::vector<int> NodeImage::RegionsIn(uint64_t offset, uint64_t length) const {
  std::vector<int> regions;
  ForEachPiece(offset, length,
               [&](int region, uint64_t, uint64_t, uint64_t) { regions.push_back(region); });
  return regions;
}

std::vector<absl::Span<const uint8_t>> NodeImage::Spans(uint64_t offset, uint64_t length) const {
  std::vector<absl::Span<const uint8_t>> spans;
  ForEachSpan(offset, length, [&](const uint8_t* data, uint64_t bytes, uint64_t) {
    if (!spans.empty() && spans.back().data() + spans.back().size() == data) {
      spans.back() = {spans.back().data(), spans.back().size() + bytes};
    } else {
      spans.emplace_back(data, bytes);
    }
  });
  return spans;
}

void NodeImage::Write(uint64_t offset, const uint8_t* in, uint64_t length) const {
  ForEachPiece(offset, length, [&](int region, uint64_t in_region, uint64_t in_range, uint64_t bytes) {
    stored_[region]->Write(in_region, in + in_range, bytes);
  });
}

uint8_t* NodeImage::Contiguous(uint64_t offset, uint64_t length) const {
  uint8_t* whole = nullptr;
  ForEachPiece(offset, length,
               [&](int region, uint64_t in_region, uint64_t in_range, uint64_t bytes) {
                 if (in_range == 0 && bytes == length) {
                   whole = stored_[region]->Contiguous(in_region, bytes);
                 }
               });
  return whole;
}

std::vector<std::pair<int, uint32_t>> NodeImage::CorruptChunks() const {
  std::vector<std::pair<int, uint32_t>> corrupt;
  for (int i = 0; i < memory_.manifest->regions_size(); ++i) {
    const v1::ImageRegion& region = memory_.manifest->regions(i);
    for (int chunk = 0; chunk < region.chunk_crcs_size(); ++chunk) {
      const uint64_t begin = uint64_t(chunk) * region.chunk_bytes();
      const uint64_t bytes = std::min(region.chunk_bytes(), region.bytes() - begin);
      if (stored_[i]->Crc32c(begin, bytes) != region.chunk_crcs(chunk)) {
        corrupt.emplace_back(i, static_cast<uint32_t>(chunk));
      }
    }
  }
  return corrupt;
}

std::pair<uint64_t, uint64_t> NodeImage::ChunkRange(int region, uint32_t chunk) const {
  const v1::ImageRegion& info = memory_.manifest->regions(region);
  const uint64_t begin = uint64_t{chunk} * info.chunk_bytes();
  return {starts_[region] + begin, std::min(info.chunk_bytes(), info.bytes() - begin)};
}

std::optional<std::vector<bool>> ChangedUnits(const v1::NodeImage& before,
                                              const v1::NodeImage& after, uint64_t unit_bytes) {
  if (before.regions_size() != after.regions_size()) return std::nullopt;
  // One pass over both images, which a step of thousands of regions per member walks every time.
  std::vector<bool> changed;
  uint64_t offset = 0;
  for (int i = 0; i < after.regions_size(); ++i) {
    const v1::ImageRegion& was = before.regions(i);
    const v1::ImageRegion& region = after.regions(i);
    if (!SameRegion(was, region)) return std::nullopt;
    if (region.bytes() > 0 && region.step() != was.step()) {
      MarkUnits(offset, region.bytes(), unit_bytes, changed);
    }
    offset += region.bytes();
  }
  changed.resize((offset + unit_bytes - 1) / unit_bytes, false);
  return changed;
}

std::optional<std::vector<bool>> ChangedUnitsAt(const v1::NodeImage& before,
                                                const v1::NodeImage& after,
                                                absl::Span<const uint32_t> positions,
                                                uint64_t unit_bytes) {
  if (before.regions_size() != after.regions_size()) return std::nullopt;
  std::vector<bool> changed((after.bytes() + unit_bytes - 1) / unit_bytes, false);
  uint64_t offset = 0;  // of region `next`
  int next = 0;
  for (const uint32_t position : positions) {
    if (position < static_cast<uint32_t>(next) ||
        position >= static_cast<uint32_t>(after.regions_size())) {
      return std::nullopt;
    }
    // Only each region's size is read on the way: a sparse step of thousands of regions per member
    // compares its few changed ones.
    for (; next < static_cast<int>(position); ++next) offset += after.regions(next).bytes();
    const v1::ImageRegion& was = before.regions(next);
    const v1::ImageRegion& region = after.regions(next);
    if (!SameRegion(was, region)) return std::nullopt;
    if (offset > after.bytes() || region.bytes() > after.bytes() - offset) {
      return std::nullopt;  // not within the image's bytes: they are not its regions' sum
    }
    if (region.bytes() > 0 && region.step() != was.step()) {
      MarkUnits(offset, region.bytes(), unit_bytes, changed);
    }
  }
  return changed;
}

}  // namespace moesnap::daemon
