// How a device backend cuts a batch of transfers: slices in groups of a fixed size, runs
// contiguous on both sides (and in one allocation) copied as one, and CRC-32Cs extended slice by
// slice equal to the CRC of each chunk's bytes, chained across the transfers that continue one.
#include "daemon/transfer_groups.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "erasure/crc32c.h"

namespace moesnap::daemon {
namespace {

using ::testing::ElementsAre;

constexpr uint64_t kMiB = 1 << 20;

// Slices as (transfer, at, bytes), for comparison.
std::vector<std::tuple<size_t, uint64_t, uint64_t>> Cut(
    std::span<const TransferGroups::Slice> slices) {
  std::vector<std::tuple<size_t, uint64_t, uint64_t>> cut;
  for (const TransferGroups::Slice& slice : slices) {
    cut.emplace_back(slice.transfer, slice.at, slice.bytes);
  }
  return cut;
}

TEST(TransferGroupsTest, SlicesFillGroupsOfTheGivenSizeAcrossTransfersInOrder) {
  std::vector<Transfer> transfers = {{.bytes = 3 * kMiB / 2}, {.bytes = kMiB / 4}, {.bytes = kMiB}};
  const TransferGroups groups(transfers, kMiB);
  ASSERT_EQ(groups.groups(), 3u);  // 2.75 MiB: two full groups and the rest
  EXPECT_THAT(Cut(groups.group(0)), ElementsAre(std::make_tuple(0, 0, kMiB)));
  EXPECT_THAT(Cut(groups.group(1)),
              ElementsAre(std::make_tuple(0, kMiB, kMiB / 2), std::make_tuple(1, 0, kMiB / 4),
                          std::make_tuple(2, 0, kMiB / 4)));
  EXPECT_THAT(Cut(groups.group(2)), ElementsAre(std::make_tuple(2, kMiB / 4, 3 * kMiB / 4)));
  EXPECT_EQ(TransferGroups({}, kMiB).groups(), 0u);
}

// Device memory modelled as host memory: a transfer's source is the allocation it lies in, which
// starts at `base`.
struct FakeAllocation : RegionSource {
  FakeAllocation(uint8_t* start, uint64_t size) : base(start), size_(size) {}
  uint64_t bytes() const override { return size_; }
  uint8_t* base;
  uint64_t size_;
};

using CopyRun = std::tuple<uint8_t*, uint8_t*, uint64_t>;  // device, host, bytes

std::vector<CopyRun> Runs(std::span<const Transfer> transfers) {
  const TransferGroups cut(transfers, kMiB);
  std::vector<CopyRun> runs;
  const absl::Status status = TransferGroups::CopyContiguous(
      transfers, cut.group(0),
      [](const Transfer& transfer, uint64_t at) {
        return static_cast<FakeAllocation*>(transfer.source)->base + transfer.offset + at;
      },
      [](const Transfer& transfer) -> const void* { return transfer.source; },
      [&](uint8_t* device, uint8_t* host, uint64_t bytes) {
        runs.emplace_back(device, host, bytes);
        return absl::OkStatus();
      });
  EXPECT_TRUE(status.ok()) << status;
  return runs;
}

TEST(TransferGroupsTest, RegionsContiguousOnBothSidesInOneAllocationMoveAsOneCopy) {
  std::vector<uint8_t> device(64 * 1024);
  std::vector<uint8_t> pool(64 * 1024);
  FakeAllocation block(device.data(), device.size());
  std::vector<Transfer> transfers;
  for (uint32_t i = 0; i < 8; ++i) {
    transfers.push_back({&block, i * 4096u, pool.data() + i * 4096, 4096});
  }
  EXPECT_THAT(Runs(transfers), ElementsAre(CopyRun{device.data(), pool.data(), 8 * 4096}));

  // A gap in the pool (before and after region 2), a gap on the device (around region 5), and a
  // region of another allocation lying right after region 6 in the address space each start a new
  // copy.
  FakeAllocation next_door(device.data() + 7 * 4096, 4096);
  transfers[2].host += 64;
  transfers[5].offset += 64;
  transfers[7] = {&next_door, 0, pool.data() + 7 * 4096, 4096};
  std::vector<uint64_t> sizes;
  for (const CopyRun& run : Runs(transfers)) sizes.push_back(std::get<2>(run));
  EXPECT_THAT(sizes, ElementsAre(2 * 4096, 4096, 2 * 4096, 4096, 4096, 4096));
}

TEST(TransferGroupsTest, CrcsExtendedSliceBySliceEqualTheCrcOfEachChunk) {
  std::vector<uint8_t> pool(10000);
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<uint8_t>(i * 131 + i / 251);
  const uint32_t prefix = erasure::Crc32c("earlier bytes", 13);
  // A chunk in three pool extents, a chunk in one, and a chunk that continues an earlier CRC.
  std::vector<Transfer> transfers = {
      {.host = pool.data(), .bytes = 2500},
      {.host = pool.data() + 2500, .bytes = 1500, .continues = true},
      {.host = pool.data() + 4000, .bytes = 3000, .continues = true},
      {.host = pool.data() + 7000, .bytes = 2000},
      {.host = pool.data() + 9000, .bytes = 1000, .crc = prefix},
  };
  const TransferGroups groups(transfers, 999);  // slices cut inside every transfer
  ASSERT_EQ(groups.groups(), 11u);
  for (size_t group = 0; group < groups.groups(); ++group) {
    TransferGroups::ExtendCrcs(transfers, groups.group(group));
  }
  EXPECT_EQ(transfers[2].crc, erasure::Crc32c(pool.data(), 7000));
  EXPECT_EQ(transfers[3].crc, erasure::Crc32c(pool.data() + 7000, 2000));
  EXPECT_EQ(transfers[4].crc, erasure::Crc32cExtend(prefix, pool.data() + 9000, 1000));
}

}  // namespace
}  // namespace moesnap::daemon
