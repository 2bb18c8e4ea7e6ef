// ExtentAllocator: best fit over a coalesced free map, indexed by offset and by size.
#include "daemon/extent_allocator.h"

#include <iterator>

namespace moesnap::daemon {

ExtentAllocator::ExtentAllocator(uint64_t capacity) : capacity_(capacity) {
  if (capacity_ > 0) Insert({0, capacity_});
}

std::optional<uint64_t> ExtentAllocator::RoundUp(uint64_t bytes, uint64_t limit) {
  if (bytes == 0) bytes = 1;
  const uint64_t rounded = bytes + (kAlignment - bytes % kAlignment) % kAlignment;
  if (rounded < bytes || rounded > limit) return std::nullopt;  // wrapped past 2^64, or too big
  return rounded;
}

void ExtentAllocator::Insert(Range range) {
  by_offset_.emplace(range.offset, range.bytes);
  by_size_.emplace(range.bytes, range.offset);
  free_bytes_ += range.bytes;
}

void ExtentAllocator::Erase(std::map<uint64_t, uint64_t>::iterator hole) {
  auto [first, last] = by_size_.equal_range(hole->second);
  for (auto it = first; it != last; ++it) {
    if (it->second == hole->first) {
      by_size_.erase(it);
      break;
    }
  }
  free_bytes_ -= hole->second;
  by_offset_.erase(hole);
}

std::optional<ExtentAllocator::Range> ExtentAllocator::AllocateContiguous(uint64_t bytes) {
  const std::optional<uint64_t> needed = RoundUp(bytes, free_bytes_);
  if (!needed) return std::nullopt;
  auto fit = by_size_.lower_bound(*needed);
  if (fit == by_size_.end()) return std::nullopt;
  const Range hole{fit->second, fit->first};
  Erase(by_offset_.find(hole.offset));
  if (hole.bytes > *needed) Insert({hole.offset + *needed, hole.bytes - *needed});
  return Range{hole.offset, *needed};
}

std::vector<ExtentAllocator::Range> ExtentAllocator::AllocatePieces(uint64_t bytes) {
  const std::optional<uint64_t> needed = RoundUp(bytes, free_bytes_);
  if (!needed) return {};
  if (std::optional<Range> whole = AllocateContiguous(*needed)) return {*whole};
  // Fragmented: the fewest pieces are the largest holes. The last hole is split, its rest kept.
  std::vector<Range> pieces;
  uint64_t missing = *needed;
  while (missing > 0) {
    auto largest = std::prev(by_size_.end());
    const Range hole{largest->second, largest->first};
    Erase(by_offset_.find(hole.offset));
    const uint64_t taken = hole.bytes < missing ? hole.bytes : missing;
    if (taken < hole.bytes) Insert({hole.offset + taken, hole.bytes - taken});
    pieces.push_back({hole.offset, taken});
    missing -= taken;
  }
  return pieces;
}

bool ExtentAllocator::Claim(Range range) {
  if (range.offset % kAlignment != 0 || range.bytes == 0 || range.bytes % kAlignment != 0 ||
      range.offset > capacity_ || range.bytes > capacity_ - range.offset) {
    return false;
  }
  auto hole = by_offset_.upper_bound(range.offset);
  if (hole == by_offset_.begin()) return false;
  --hole;
  const Range free{hole->first, hole->second};
  if (range.offset + range.bytes > free.offset + free.bytes) return false;
  Erase(hole);
  if (range.offset > free.offset) Insert({free.offset, range.offset - free.offset});
  const uint64_t end = range.offset + range.bytes;
  if (free.offset + free.bytes > end) Insert({end, free.offset + free.bytes - end});
  return true;
}

void ExtentAllocator::Free(Range range) {
  auto next = by_offset_.lower_bound(range.offset);
  if (next != by_offset_.end() && range.offset + range.bytes == next->first) {
    range.bytes += next->second;
    Erase(next);
  }
  auto following = by_offset_.lower_bound(range.offset);
  if (following != by_offset_.begin()) {
    auto previous = std::prev(following);
    if (previous->first + previous->second == range.offset) {
      range = {previous->first, previous->second + range.bytes};
      Erase(previous);
    }
  }
  Insert(range);
}

uint64_t ExtentAllocator::largest_free() const {
  return by_size_.empty() ? 0 : std::prev(by_size_.end())->first;
}

}  // namespace moesnap::daemon
