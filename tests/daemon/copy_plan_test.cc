// How a step's copy is cut into tasks and laid out in its pool reservation.
#include "daemon/copy_plan.h"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

namespace moesnap::daemon {
namespace {

constexpr uint64_t kChunk = 4096;

CopyPlan PlanOf(const std::vector<uint64_t>& sizes) {
  return PlanCopy(
      sizes.size(), [&](uint32_t position) { return sizes[position]; },
      [](uint32_t) { return kChunk; }, kChunk);
}

TEST(CopyPlanTest, RunsOfSmallRegionsShareAPartUpToAChunkAndALargeOneHasAPartPerChunk) {
  // Parts: [0, 3) of 4000 bytes; [3, 4) since 100 + 4096 passes a chunk; [4, 5) of exactly a
  // chunk; three chunks of region 5; then [6, 8).
  const std::vector<uint64_t> sizes{1000, 1000, 2000, 100, 4096, 2 * kChunk + 1, 10, 10};
  const CopyPlan plan = PlanOf(sizes);
  ASSERT_EQ(plan.parts.size(), 7u);
  EXPECT_EQ(plan.parts[0].first, 0u);
  EXPECT_EQ(plan.parts[0].last, 3u);  // 4000 bytes; the fourth region would pass 4096
  EXPECT_FALSE(plan.parts[0].chunk);
  EXPECT_EQ(plan.parts[1].first, 3u);
  EXPECT_EQ(plan.parts[1].last, 4u);  // 100 + 4096 would pass a chunk
  EXPECT_EQ(plan.parts[2].first, 4u);
  EXPECT_EQ(plan.parts[2].last, 5u);  // exactly one chunk is still small
  for (uint32_t chunk = 0; chunk < 3; ++chunk) {
    const CopyPlan::Part& part = plan.parts[3 + chunk];
    EXPECT_EQ(part.first, 5u);
    EXPECT_EQ(part.last, 6u);
    ASSERT_TRUE(part.chunk);
    EXPECT_EQ(*part.chunk, chunk);
  }
  EXPECT_EQ(plan.parts[6].first, 6u);
  EXPECT_EQ(plan.parts[6].last, 8u);
  EXPECT_FALSE(plan.parts[6].chunk);
}

TEST(CopyPlanTest, EveryRegionIsInExactlyOnePartOrInOnePartPerChunk) {
  std::vector<uint64_t> sizes;
  for (uint64_t i = 0; i < 5000; ++i) sizes.push_back(1 + (i * 7919) % (3 * kChunk));
  const CopyPlan plan = PlanOf(sizes);
  std::vector<uint32_t> copied(sizes.size());
  for (const CopyPlan::Part& part : plan.parts) {
    ASSERT_LT(part.first, part.last);
    uint64_t bytes = 0;
    for (uint32_t at = part.first; at < part.last; ++at) {
      ++copied[plan.order[at]];
      bytes += sizes[plan.order[at]];
    }
    if (part.chunk) {
      EXPECT_EQ(part.last, part.first + 1);
      EXPECT_GT(sizes[plan.order[part.first]], kChunk);
    } else if (part.last - part.first > 1) {
      EXPECT_LE(bytes, kChunk);
    }
  }
  for (uint32_t position = 0; position < sizes.size(); ++position) {
    const uint32_t chunks = static_cast<uint32_t>((sizes[position] + kChunk - 1) / kChunk);
    EXPECT_EQ(copied[position], chunks > 1 ? chunks : 1u) << "region " << position;
  }
}

TEST(CopyPlanTest, RegionsTakeConsecutiveAlignedSpaceInTheReservation) {
  const std::vector<uint64_t> sizes{1, 64, 65, 10000, 3};
  const CopyPlan plan = PlanOf(sizes);
  EXPECT_EQ(plan.offsets, (std::vector<uint64_t>{0, 64, 128, 256, 10304}));
  EXPECT_EQ(plan.space, 10368u);
  EXPECT_EQ(plan.bytes, 1u + 64 + 65 + 10000 + 3);
  EXPECT_EQ(plan.large, (std::vector<uint32_t>{3}));
}

TEST(CopyPlanTest, RegionsAreLaidOutAndCopiedInTheOrderGiven) {
  // Positions 0..3 lie in the trainer's memory as 2, 0, 3, 1: the reservation holds them so, and
  // a part is a run of that order.
  const std::vector<uint64_t> sizes{100, 200, 64, 3 * kChunk};
  const CopyPlan plan = PlanCopy(
      sizes.size(), [&](uint32_t position) { return sizes[position]; },
      [](uint32_t) { return kChunk; }, kChunk, std::numeric_limits<uint64_t>::max(), {2, 0, 3, 1});
  EXPECT_EQ(plan.order, (std::vector<uint32_t>{2, 0, 3, 1}));
  EXPECT_EQ(plan.offsets, (std::vector<uint64_t>{64, 12480, 0, 192}));
  ASSERT_EQ(plan.parts.size(), 5u);
  EXPECT_EQ(plan.parts[0].first, 0u);  // positions 2 and 0
  EXPECT_EQ(plan.parts[0].last, 2u);
  for (int chunk = 0; chunk < 3; ++chunk) EXPECT_EQ(plan.order[plan.parts[1 + chunk].first], 3u);
  EXPECT_EQ(plan.order[plan.parts[4].first], 1u);
  EXPECT_EQ(plan.large, (std::vector<uint32_t>{3}));
}

TEST(CopyPlanTest, OrderByRankSortsByRankAndKeepsTheOrderOfEqualRanks) {
  const std::vector<uint32_t> ranks{3, 1, 3, 0, 1};
  EXPECT_EQ(OrderByRank(ranks.size(), [&](uint32_t position) { return ranks[position]; }, 4),
            (std::vector<uint32_t>{3, 1, 4, 0, 2}));
  EXPECT_TRUE(OrderByRank(0, [](uint32_t) { return 0u; }, 0).empty());
}

TEST(CopyPlanTest, SizesFromATrainerNear2To64SaturateInsteadOfWrapping) {
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  const CopyPlan plan = PlanOf({max - 3, 128});
  EXPECT_EQ(plan.space, max);  // no pool reserves it
  EXPECT_EQ(plan.bytes, max);
}

// What a trainer may declare (65,536 regions of 1 TiB over one sparse file) plans no more parts
// than the pool's chunks: a plan past the pool is never copied, so its parts are not made.
TEST(CopyPlanTest, RegionsPastThePoolGetNoParts) {
  constexpr uint64_t kPoolBytes = uint64_t{1} << 30;
  constexpr uint64_t kRegionBytes = uint64_t{1} << 40;
  const CopyPlan plan = PlanCopy(
      65536, [](uint32_t) { return kRegionBytes; }, [](uint32_t) { return kChunk; }, kChunk,
      kPoolBytes);
  EXPECT_GT(plan.space, kPoolBytes);
  EXPECT_EQ(plan.bytes, 65536 * kRegionBytes);
  EXPECT_TRUE(plan.parts.empty());  // the first region alone passes the pool
  EXPECT_EQ(plan.offsets.size(), 65536u);

  // Regions within the pool are planned as always, those after the limit are not.
  const CopyPlan partial = PlanCopy(
      3, [](uint32_t) { return 3 * kChunk; }, [](uint32_t) { return kChunk; }, kChunk,
      7 * kChunk);
  EXPECT_EQ(partial.parts.size(), 6u);  // regions 0 and 1, three chunks each
  EXPECT_EQ(partial.large, (std::vector<uint32_t>{0, 1}));
}

}  // namespace
}  // namespace moesnap::daemon
