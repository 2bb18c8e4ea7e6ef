// Which byte ranges of the pool are free. It knows offsets only, no memory, so that its decisions
// are tested alone. A stored version may take its bytes in several pieces: a request is refused
// only when fewer bytes are free than it needs, never because the free bytes are not contiguous.
#ifndef MOESNAP_DAEMON_EXTENT_ALLOCATOR_H_
#define MOESNAP_DAEMON_EXTENT_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace moesnap::daemon {

// Not thread-safe: the pool serializes its calls.
class ExtentAllocator {
 public:
  // Every range starts and ends on this boundary, so SIMD copies and CRC loops run aligned.
  static constexpr uint64_t kAlignment = 64;

  struct Range {
    uint64_t offset = 0;
    uint64_t bytes = 0;
    bool operator==(const Range&) const = default;
  };

  // Manages [0, capacity); `capacity` is a multiple of kAlignment.
  explicit ExtentAllocator(uint64_t capacity);

  // `bytes` rounded up to kAlignment, or absent when it exceeds `limit`.
  static std::optional<uint64_t> RoundUp(uint64_t bytes, uint64_t limit);

  // One range of RoundUp(bytes) (the smallest hole that fits), or absent.
  std::optional<Range> AllocateContiguous(uint64_t bytes);
  // RoundUp(bytes) in as few ranges as the free space allows: one when a hole fits it, otherwise
  // the largest holes first, the last one split. Empty (nothing taken) when fewer bytes are free.
  std::vector<Range> AllocatePieces(uint64_t bytes);
  // Takes a specific range (a version found in the journal at start-up); false when any of it is
  // not free or it is not aligned.
  bool Claim(Range range);
  // Returns a range handed out before; neighbours coalesce.
  void Free(Range range);

  uint64_t capacity() const { return capacity_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free() const;
  size_t holes() const { return by_offset_.size(); }

 private:
  void Insert(Range range);
  void Erase(std::map<uint64_t, uint64_t>::iterator hole);

  const uint64_t capacity_;
  uint64_t free_bytes_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;        // offset -> bytes, coalesced
  std::multimap<uint64_t, uint64_t> by_size_;     // bytes -> offset, for best fit
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_EXTENT_ALLOCATOR_H_
