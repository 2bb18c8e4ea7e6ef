// ExtentAllocator: best fit, pieces when the free space is fragmented, coalescing, claims of
// journaled ranges, and a random workload that checks its bookkeeping after every call.
#include "daemon/extent_allocator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <vector>

namespace moesnap::daemon {
namespace {

using Range = ExtentAllocator::Range;
constexpr uint64_t kUnit = ExtentAllocator::kAlignment;

TEST(ExtentAllocatorTest, RoundsUpAndRefusesWhatWouldWrap) {
  EXPECT_EQ(ExtentAllocator::RoundUp(0, 1 << 20), kUnit);
  EXPECT_EQ(ExtentAllocator::RoundUp(1, 1 << 20), kUnit);
  EXPECT_EQ(ExtentAllocator::RoundUp(kUnit + 1, 1 << 20), 2 * kUnit);
  EXPECT_EQ(ExtentAllocator::RoundUp(std::numeric_limits<uint64_t>::max() - 3,
                                     std::numeric_limits<uint64_t>::max()),
            std::nullopt);
  EXPECT_EQ(ExtentAllocator::RoundUp((1 << 20) + 1, 1 << 20), std::nullopt);
}

TEST(ExtentAllocatorTest, BestFitTakesTheSmallestHoleThatFits) {
  ExtentAllocator allocator(100 * kUnit);
  const Range a = *allocator.AllocateContiguous(10 * kUnit);
  const Range b = *allocator.AllocateContiguous(5 * kUnit);
  const Range c = *allocator.AllocateContiguous(20 * kUnit);
  const Range d = *allocator.AllocateContiguous(3 * kUnit);
  allocator.Free(a);  // a hole of 10 units
  allocator.Free(c);  // a hole of 20 units; the tail is a hole of 62
  EXPECT_EQ(allocator.holes(), 3u);
  EXPECT_EQ(allocator.AllocateContiguous(8 * kUnit), (Range{a.offset, 8 * kUnit}));
  EXPECT_EQ(allocator.AllocateContiguous(15 * kUnit), (Range{c.offset, 15 * kUnit}));
  EXPECT_EQ(allocator.AllocateContiguous(40 * kUnit), (Range{d.offset + d.bytes, 40 * kUnit}));
  EXPECT_EQ(b.offset, a.offset + a.bytes);
}

TEST(ExtentAllocatorTest, FragmentedFreeSpaceIsHandedOutInPiecesLargestFirst) {
  ExtentAllocator allocator(40 * kUnit);
  std::vector<Range> taken;
  for (int i = 0; i < 8; ++i) taken.push_back(*allocator.AllocateContiguous(5 * kUnit));
  // Free every other one: 4 holes of 5 units, none adjacent.
  for (int i = 0; i < 8; i += 2) allocator.Free(taken[i]);
  EXPECT_EQ(allocator.free_bytes(), 20 * kUnit);
  EXPECT_EQ(allocator.largest_free(), 5 * kUnit);
  EXPECT_EQ(allocator.AllocateContiguous(12 * kUnit), std::nullopt);
  EXPECT_TRUE(allocator.AllocatePieces(21 * kUnit).empty());  // more than is free: nothing taken
  EXPECT_EQ(allocator.free_bytes(), 20 * kUnit);
  const std::vector<Range> pieces = allocator.AllocatePieces(12 * kUnit);
  ASSERT_EQ(pieces.size(), 3u);
  uint64_t total = 0;
  for (const Range& piece : pieces) total += piece.bytes;
  EXPECT_EQ(total, 12 * kUnit);
  EXPECT_EQ(pieces[2].bytes, 2 * kUnit);  // the last hole is split; its rest stays free
  EXPECT_EQ(allocator.free_bytes(), 8 * kUnit);
  EXPECT_EQ(allocator.AllocatePieces(8 * kUnit).size(), 2u);
  EXPECT_EQ(allocator.free_bytes(), 0u);
}

TEST(ExtentAllocatorTest, FreeCoalescesWithBothNeighbours) {
  ExtentAllocator allocator(30 * kUnit);
  const Range a = *allocator.AllocateContiguous(10 * kUnit);
  const Range b = *allocator.AllocateContiguous(10 * kUnit);
  const Range c = *allocator.AllocateContiguous(10 * kUnit);
  allocator.Free(a);
  allocator.Free(c);
  EXPECT_EQ(allocator.holes(), 2u);
  allocator.Free(b);
  EXPECT_EQ(allocator.holes(), 1u);
  EXPECT_EQ(allocator.largest_free(), 30 * kUnit);
  EXPECT_EQ(allocator.AllocateContiguous(30 * kUnit), (Range{0, 30 * kUnit}));
}

TEST(ExtentAllocatorTest, ClaimTakesOnlyFreeAlignedRangesInsideThePool) {
  ExtentAllocator allocator(16 * kUnit);
  EXPECT_TRUE(allocator.Claim({4 * kUnit, 2 * kUnit}));
  EXPECT_FALSE(allocator.Claim({5 * kUnit, kUnit}));            // taken
  EXPECT_FALSE(allocator.Claim({3 * kUnit, 2 * kUnit}));        // overlaps a taken range
  EXPECT_FALSE(allocator.Claim({kUnit + 1, kUnit}));            // not aligned
  EXPECT_FALSE(allocator.Claim({15 * kUnit, 2 * kUnit}));       // past the end
  EXPECT_FALSE(allocator.Claim({std::numeric_limits<uint64_t>::max() - kUnit + 1, kUnit}));
  EXPECT_FALSE(allocator.Claim({0, 0}));
  EXPECT_TRUE(allocator.Claim({0, 4 * kUnit}));
  EXPECT_TRUE(allocator.Claim({6 * kUnit, 10 * kUnit}));
  EXPECT_EQ(allocator.free_bytes(), 0u);
}

// Random allocations and frees: after every call the free bytes and the ranges handed out account
// for the whole pool without overlap, and pieces are refused only when too few bytes are free.
TEST(ExtentAllocatorTest, RandomWorkloadKeepsTheBooksExact) {
  constexpr uint64_t kCapacity = 4096 * kUnit;
  ExtentAllocator allocator(kCapacity);
  std::mt19937_64 random(12345);
  std::map<uint64_t, uint64_t> held;  // offset -> bytes
  std::vector<std::vector<Range>> allocations;
  for (int round = 0; round < 20000; ++round) {
    if (!allocations.empty() && random() % 2 == 0) {
      const size_t victim = random() % allocations.size();
      for (const Range& range : allocations[victim]) {
        allocator.Free(range);
        held.erase(range.offset);
      }
      allocations.erase(allocations.begin() + static_cast<std::ptrdiff_t>(victim));
    } else {
      const uint64_t bytes = 1 + random() % (300 * kUnit);
      const uint64_t rounded = *ExtentAllocator::RoundUp(bytes, kCapacity);
      const uint64_t free_before = allocator.free_bytes();
      std::vector<Range> pieces = allocator.AllocatePieces(bytes);
      ASSERT_EQ(pieces.empty(), rounded > free_before) << "round " << round;
      uint64_t total = 0;
      for (const Range& piece : pieces) {
        total += piece.bytes;
        ASSERT_EQ(piece.offset % kUnit, 0u);
        held[piece.offset] = piece.bytes;
      }
      if (!pieces.empty()) {
        ASSERT_EQ(total, rounded);
        allocations.push_back(std::move(pieces));
      }
    }
    uint64_t in_use = 0, end = 0;
    for (const auto& [offset, bytes] : held) {
      ASSERT_GE(offset, end) << "ranges overlap in round " << round;
      end = offset + bytes;
      in_use += bytes;
    }
    ASSERT_LE(end, kCapacity);
    ASSERT_EQ(in_use + allocator.free_bytes(), kCapacity) << "round " << round;
  }
}

}  // namespace
}  // namespace moesnap::daemon
