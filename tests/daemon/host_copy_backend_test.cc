// The host copy backend's restore batches: runs of chunks adjacent in the trainer's memory and in
// the pool are copied in one pass and checked against their stored CRCs joined; everything else,
// and every chunk of a run whose check fails, one chunk at a time. Whatever path a chunk takes, it
// lands exactly and reports the CRC-32C of its own bytes.
#include "daemon/copy_backend.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <vector>

#include "erasure/crc32c.h"
#include "tests/testing/deterministic_bytes.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kRegionBytes = 16 * kKiB;

// Rank 0's memory: two regions of 16 KiB, A at 0 and B at 32 KiB (a gap between them).
class HostCopyBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<TrainerSessions::Session> session =
        sessions_.Start(0, {.uid = geteuid(), .pid = getpid()});
    ASSERT_OK(session);
    fd_ = memfd_create("host-copy-backend-test", MFD_CLOEXEC);
    ASSERT_EQ(ftruncate(fd_, kMemoryBytes), 0);
    trainer_ = static_cast<uint8_t*>(
        mmap(nullptr, kMemoryBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0));
    ASSERT_NE(trainer_, MAP_FAILED);
    absl::StatusOr<std::shared_ptr<TrainerMemory>> memory = TrainerMemory::Map(fd_, geteuid(), {});
    ASSERT_OK(memory);
    absl::StatusOr<uint64_t> id = sessions_.Add(session->token, {*memory});
    ASSERT_OK(id);
    a_ = Open("a", *id, 0);
    b_ = Open("b", *id, 32 * kKiB);
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
    pool_ = moesnap::testing::DeterministicBytes(5).Bytes(kPoolBytes);
  }
  void TearDown() override {
    if (trainer_ != nullptr) munmap(trainer_, kMemoryBytes);
    if (fd_ >= 0) close(fd_);
  }

  std::shared_ptr<RegionSource> Open(const std::string& name, uint64_t memory, uint64_t offset) {
    v1::RegionSpec spec;
    spec.set_name(name);
    spec.set_device(v1::DEVICE_HOST);
    spec.set_bytes(kRegionBytes);
    spec.mutable_handle()->set_memory(memory);
    spec.mutable_handle()->set_shm_offset(offset);
    absl::StatusOr<std::shared_ptr<RegionSource>> source = backend_->Open(0, spec);
    EXPECT_OK(source);
    return source.value_or(nullptr);
  }

  // A chunk of one transfer: `bytes` at `offset` of `source`, from `pool` bytes on, its stored CRC
  // that of those pool bytes.
  Transfer Chunk(const std::shared_ptr<RegionSource>& source, uint64_t offset, uint64_t pool,
                 uint64_t bytes) {
    return {source.get(), offset, pool_.data() + pool, bytes, false, 0,
            erasure::Crc32c(pool_.data() + pool, bytes)};
  }

  static constexpr uint64_t kMemoryBytes = 48 * kKiB;
  static constexpr uint64_t kPoolBytes = 64 * kKiB;
  TrainerSessions sessions_;
  std::unique_ptr<CopyBackend> backend_ = CreateHostCopyBackend(&sessions_);
  int fd_ = -1;
  uint8_t* trainer_ = nullptr;
  std::shared_ptr<RegionSource> a_;
  std::shared_ptr<RegionSource> b_;
  std::vector<uint8_t> pool_;
};

TEST_F(HostCopyBackendTest, RunsGapsAndChunksOfTwoExtentsLandExactlyWithTheirOwnCrcs) {
  std::vector<Transfer> batch = {
      Chunk(a_, 0, 0, 4 * kKiB),              // a run of two: adjacent in memory and in the pool
      Chunk(a_, 4 * kKiB, 4 * kKiB, 4 * kKiB),
      Chunk(b_, 0, 8 * kKiB, 4 * kKiB),       // next in the pool, not in memory
      Chunk(b_, 4 * kKiB, 16 * kKiB, 4 * kKiB),  // next in memory, not in the pool
      // A chunk of two extents, then a chunk adjacent to it in both: no run across it.
      {b_.get(), 8 * kKiB, pool_.data() + 20 * kKiB, 2 * kKiB, false, 0},
      {b_.get(), 10 * kKiB, pool_.data() + 22 * kKiB, 2 * kKiB, true, 0},
      Chunk(b_, 12 * kKiB, 24 * kKiB, 4 * kKiB),
  };
  ASSERT_OK(backend_->CopyInBatch(batch));
  const uint8_t* b = trainer_ + 32 * kKiB;
  EXPECT_EQ(std::memcmp(trainer_, pool_.data(), 8 * kKiB), 0);
  EXPECT_EQ(std::memcmp(b, pool_.data() + 8 * kKiB, 4 * kKiB), 0);
  EXPECT_EQ(std::memcmp(b + 4 * kKiB, pool_.data() + 16 * kKiB, 12 * kKiB), 0);
  for (size_t i : {0, 1, 2, 3, 6}) EXPECT_EQ(batch[i].crc, *batch[i].expected) << "chunk " << i;
  EXPECT_EQ(batch[5].crc, erasure::Crc32c(pool_.data() + 20 * kKiB, 4 * kKiB));
}

TEST_F(HostCopyBackendTest, ARunWhoseCheckFailsReportsEachChunksOwnCrc) {
  // Four chunks adjacent in both; the third's stored CRC does not match its bytes (a damaged pool
  // is the same thing seen from the other side). Every chunk still lands, and each reports the CRC
  // of its own bytes, so that the caller names the third alone.
  std::vector<Transfer> batch;
  for (uint64_t chunk = 0; chunk < 4; ++chunk) {
    batch.push_back(Chunk(a_, chunk * 4 * kKiB, chunk * 4 * kKiB, 4 * kKiB));
  }
  const uint32_t actual = *batch[2].expected;
  batch[2].expected = actual ^ 1;
  ASSERT_OK(backend_->CopyInBatch(batch));
  EXPECT_EQ(std::memcmp(trainer_, pool_.data(), kRegionBytes), 0);
  for (size_t i : {0, 1, 3}) EXPECT_EQ(batch[i].crc, *batch[i].expected) << "chunk " << i;
  EXPECT_EQ(batch[2].crc, actual);
}

TEST_F(HostCopyBackendTest, ARunIntoMemoryTheTrainerTruncatedFailsNamingTheTruncation) {
  std::vector<Transfer> batch;
  for (uint64_t chunk = 0; chunk < 4; ++chunk) {
    batch.push_back(Chunk(b_, chunk * 4 * kKiB, chunk * 4 * kKiB, 4 * kKiB));
  }
  ASSERT_EQ(ftruncate(fd_, 40 * kKiB), 0);  // region b's last two chunks are past the file's end
  const absl::Status status = backend_->CopyInBatch(batch);
  ASSERT_STATUS(status, absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("truncated under the copy"), absl::string_view::npos) << status;
  EXPECT_EQ(std::memcmp(trainer_ + 32 * kKiB, pool_.data(), 8 * kKiB), 0);  // before the end
}

}  // namespace
}  // namespace moesnap::daemon
