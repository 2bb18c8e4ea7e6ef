// A copy task's transfers: one batch per run of chunks of one backend, each chunk's CRC-32C the
// one its last transfer ends with, and the first failure naming the chunks of its batch.
#include "daemon/task_transfers.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

namespace moesnap::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;

// Records each batch it is given as its transfers' sizes; "copies" by setting each transfer's CRC
// to its size plus the CRC it extends; fails every batch once told to.
class RecordingBackend : public CopyBackend {
 public:
  std::vector<std::vector<uint64_t>> batches;
  bool fail = false;

  std::string name() const override { return "recording"; }
  bool supports_device_memory() const override { return false; }
  absl::Status PinHostMemory(void*, uint64_t) override { return absl::OkStatus(); }
  absl::StatusOr<std::shared_ptr<RegionSource>> Open(uint32_t, const v1::RegionSpec&) override {
    return absl::UnimplementedError("not opened here");
  }
  absl::StatusOr<uint32_t> CopyOut(RegionSource&, uint64_t, uint8_t*, uint64_t bytes,
                                   uint32_t crc) override {
    return crc + static_cast<uint32_t>(bytes);
  }
  absl::StatusOr<uint32_t> CopyIn(RegionSource&, uint64_t, const uint8_t*, uint64_t,
                                  uint32_t) override {
    return absl::UnimplementedError("not copied in here");
  }
  absl::Status CopyOutBatch(std::span<Transfer> transfers) override {
    std::vector<uint64_t>& sizes = batches.emplace_back();
    for (const Transfer& transfer : transfers) sizes.push_back(transfer.bytes);
    if (fail) return absl::InternalError("injected");
    return CopyBackend::CopyOutBatch(transfers);
  }
};

// A region the recording backend never reads.
struct UnreadSource : RegionSource {
  uint64_t bytes() const override { return 0; }
};

TEST(TaskTransfersTest, ChunksOfOneBackendInARowAreOneBatchAndEachGetsItsLastTransfersCrc) {
  UnreadSource source;
  std::vector<uint8_t> pool(1 << 16);
  const PoolBytes stored = PoolBytes::View(pool.data(), pool.size());
  RecordingBackend host, device;
  auto task = [&] {  // chunks of 100, 200, 300 and 400 bytes: host, host, device, host
    TaskTransfers transfers;
    transfers.AddChunk(&host, &source, 0, stored, 0, 100);
    transfers.AddChunk(&host, &source, 0, stored, 100, 200);
    transfers.AddChunk(&device, &source, 0, stored, 300, 300);
    transfers.AddChunk(&host, &source, 0, stored, 600, 400);
    return transfers;
  };
  TaskTransfers transfers = task();
  std::vector<std::pair<size_t, uint32_t>> finished;
  std::pair<size_t, size_t> failed;
  ASSERT_TRUE(transfers
                  .Run([](CopyBackend& backend,
                          std::span<Transfer> batch) { return backend.CopyOutBatch(batch); },
                       [&](size_t chunk, uint32_t crc) { finished.emplace_back(chunk, crc); },
                       failed)
                  .ok());
  EXPECT_THAT(host.batches, ElementsAre(ElementsAre(100, 200), ElementsAre(400)));
  EXPECT_THAT(device.batches, ElementsAre(ElementsAre(300)));
  // Each chunk starts its CRC afresh: one extent each here, so its CRC is its own size.
  EXPECT_THAT(finished, ElementsAre(Pair(0, 100), Pair(1, 200), Pair(2, 300), Pair(3, 400)));

  device.fail = true;
  finished.clear();
  const absl::Status status = task().Run(
      [](CopyBackend& backend, std::span<Transfer> batch) { return backend.CopyOutBatch(batch); },
      [&](size_t chunk, uint32_t crc) { finished.emplace_back(chunk, crc); }, failed);
  EXPECT_EQ(status.message(), "injected");
  EXPECT_EQ(failed, std::make_pair(size_t{2}, size_t{2}));
  EXPECT_THAT(finished, ElementsAre(Pair(0, 100), Pair(1, 200)));  // the run before it only
}

}  // namespace
}  // namespace moesnap::daemon
