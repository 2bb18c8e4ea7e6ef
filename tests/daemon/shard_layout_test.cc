// The shard layout of a replica group: every byte in exactly one shard, shards balanced within one
// alignment unit, the same cuts for the same sizes, and one member meaning the whole regions.
#include "daemon/shard_layout.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

// Every member's pieces: pieces[member][region].
std::vector<std::vector<ShardPiece>> AllPieces(const std::vector<uint64_t>& sizes, uint32_t members) {
  std::vector<std::vector<ShardPiece>> pieces;
  for (uint32_t index = 0; index < members; ++index) pieces.push_back(ShardPieces(sizes, members, index));
  return pieces;
}

// Each region is covered exactly once, in member order, and each member's pieces are one contiguous
// byte range of the concatenation; returns each member's bytes.
std::vector<uint64_t> CheckCover(const std::vector<uint64_t>& sizes, uint32_t members) {
  const auto pieces = AllPieces(sizes, members);
  std::vector<uint64_t> member_bytes(members, 0);
  for (size_t region = 0; region < sizes.size(); ++region) {
    uint64_t next = 0;
    for (uint32_t member = 0; member < members; ++member) {
      const ShardPiece& piece = pieces[member][region];
      if (piece.bytes == 0) continue;
      EXPECT_EQ(piece.offset, next) << "region " << region << " member " << member;
      next = piece.offset + piece.bytes;
      member_bytes[member] += piece.bytes;
    }
    EXPECT_EQ(next, sizes[region]) << "region " << region << " is not covered";
  }
  return member_bytes;
}

TEST(ShardLayoutTest, OneMemberCapturesEveryRegionWhole) {
  const std::vector<uint64_t> sizes{1, 4096, 12345, 3};
  const std::vector<ShardPiece> pieces = ShardPieces(sizes, 1, 0);
  ASSERT_EQ(pieces.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(pieces[i], (ShardPiece{0, sizes[i]}));
}

TEST(ShardLayoutTest, EqualShardsWhenTheTotalDividesIntoAlignedQuarters) {
  // 4 regions of 16 KiB and 4 members: shard i is region i whole.
  const std::vector<uint64_t> sizes(4, 4 * kShardAlignment);
  for (uint32_t member = 0; member < 4; ++member) {
    const auto pieces = ShardPieces(sizes, 4, member);
    for (uint32_t region = 0; region < 4; ++region) {
      const ShardPiece expected =
          region == member ? ShardPiece{0, 4 * kShardAlignment} : ShardPiece{};
      EXPECT_EQ(pieces[region], expected);
    }
  }
}

TEST(ShardLayoutTest, ARegionSpansShardsWhenItIsLargerThanOne) {
  // One region of 10 units over 3 members: cuts at 3, 6 units (rounded down from 3.33, 6.67).
  const std::vector<uint64_t> sizes{10 * kShardAlignment};
  EXPECT_EQ(ShardPieces(sizes, 3, 0)[0], (ShardPiece{0, 3 * kShardAlignment}));
  EXPECT_EQ(ShardPieces(sizes, 3, 1)[0], (ShardPiece{3 * kShardAlignment, 3 * kShardAlignment}));
  EXPECT_EQ(ShardPieces(sizes, 3, 2)[0], (ShardPiece{6 * kShardAlignment, 4 * kShardAlignment}));
}

TEST(ShardLayoutTest, SizesNotDivisibleAreBalancedWithinOneUnitAndCoverEveryByte) {
  std::mt19937_64 random(21);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<uint64_t> sizes(1 + random() % 20);
    uint64_t total = 0;
    for (uint64_t& size : sizes) {
      size = 1 + random() % (trial % 2 == 0 ? 100000 : 3 * kShardAlignment);
      total += size;
    }
    const auto members = static_cast<uint32_t>(1 + random() % 8);
    const std::vector<uint64_t> bytes = CheckCover(sizes, members);
    uint64_t sum = 0;
    for (uint32_t member = 0; member < members; ++member) {
      sum += bytes[member];
      // Every cut is within one unit of its exact place, so a shard is within two units of 1/N.
      const double ideal = static_cast<double>(total) / members;
      EXPECT_LE(std::abs(static_cast<double>(bytes[member]) - ideal), 2.0 * kShardAlignment)
          << "trial " << trial << " member " << member << " of " << members;
    }
    EXPECT_EQ(sum, total);
  }
}

TEST(ShardLayoutTest, RegionsSmallerThanAShardLieInOneShardEach) {
  // 8 regions of 3000 bytes (24000 in all) over 2 members: the cut is at 8 KiB (12000 rounded
  // down); region 2 (6000..9000) is split by it, the others lie in one shard.
  const std::vector<uint64_t> sizes(8, 3000);
  const auto first = ShardPieces(sizes, 2, 0);
  const auto second = ShardPieces(sizes, 2, 1);
  EXPECT_EQ(first[0], (ShardPiece{0, 3000}));
  EXPECT_EQ(first[1], (ShardPiece{0, 3000}));
  EXPECT_EQ(first[2], (ShardPiece{0, 8192 - 6000}));
  EXPECT_EQ(second[2], (ShardPiece{8192 - 6000, 9000 - 8192}));
  for (size_t region = 3; region < 8; ++region) {
    EXPECT_EQ(first[region], ShardPiece{});
    EXPECT_EQ(second[region], (ShardPiece{0, 3000}));
  }
  CheckCover(sizes, 2);
}

TEST(ShardLayoutTest, MoreMembersThanUnitsLeavesSomeShardsEmpty) {
  // 5000 bytes over 4 members: cuts at 0, 0, 0, 0 (1250, 2500, 3750 round down to 0): the last
  // member holds everything, and the others nothing — still every byte exactly once.
  const std::vector<uint64_t> sizes{5000};
  EXPECT_EQ(ShardPieces(sizes, 4, 0)[0], ShardPiece{});
  EXPECT_EQ(ShardPieces(sizes, 4, 3)[0], (ShardPiece{0, 5000}));
  CheckCover(sizes, 4);
}

TEST(ShardLayoutTest, TheSameSizesGiveTheSameCuts) {
  const std::vector<uint64_t> sizes{123456, 7, 999999, 4096, 1};
  for (uint32_t member = 0; member < 4; ++member) {
    EXPECT_EQ(ShardPieces(sizes, 4, member), ShardPieces(sizes, 4, member));
  }
}

TEST(ShardLayoutTest, HugeTotalsDoNotOverflow) {
  const uint64_t huge = uint64_t{1} << 62;
  EXPECT_EQ(ShardStart(huge, 4, 2), huge / 2);
  EXPECT_EQ(ShardStart(huge, 4, 4), huge);
  CheckCover({huge / 2, huge / 2 + 12345}, 3);
}

TEST(ShardLayoutTest, DeclarationsAreChecked) {
  v1::ReplicaGroup group;
  group.set_name("dp");
  group.add_ranks(0);
  group.add_ranks(2);
  EXPECT_OK(CheckReplicaGroup(2, "w", group));
  EXPECT_EQ(MemberIndex(2, group), 1u);
  EXPECT_STATUS(CheckReplicaGroup(1, "w", group), absl::StatusCode::kInvalidArgument);
  group.add_ranks(0);
  EXPECT_STATUS(CheckReplicaGroup(0, "w", group), absl::StatusCode::kInvalidArgument);
  v1::ReplicaGroup unnamed;
  unnamed.add_ranks(0);
  EXPECT_STATUS(CheckReplicaGroup(0, "w", unnamed), absl::StatusCode::kInvalidArgument);
  v1::ReplicaGroup empty;
  empty.set_name("dp");
  EXPECT_STATUS(CheckReplicaGroup(0, "w", empty), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moesnap::daemon
