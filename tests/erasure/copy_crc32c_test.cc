// CopyWithCrc32c against memcpy + Crc32cExtend, through every kernel this CPU runs: random sizes
// and misalignments on both sides, lengths on each side of the kernels' block boundaries, and a
// source rewritten during the copy.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "erasure/crc32c.h"
#include "tests/testing/deterministic_bytes.h"

namespace moesnap::erasure {
namespace {

constexpr size_t kSlack = 128;  // bytes around every destination that must stay untouched
constexpr uint8_t kFence = 0xa5;

std::string KernelName(CopyCrcKernel kernel) {
  switch (kernel) {
    case CopyCrcKernel::kInterleaved:
      return "Interleaved";
    case CopyCrcKernel::kInterleavedWide:
      return "InterleavedWide";
    case CopyCrcKernel::kBlocked:
      return "Blocked";
  }
  return "Unknown";
}

class CopyCrc32cTest : public ::testing::TestWithParam<CopyCrcKernel> {
 protected:
  void SetUp() override {
    // Only kInterleaved can be missing, on a CPU without SSE4.2 or one that is not x86-64.
    if (!CopyCrcKernelAvailable(GetParam())) {
      GTEST_SKIP() << KernelName(GetParam()) << " does not run on this CPU";
    }
  }

  // Copies `length` bytes from `source_offset` in a random source to `destination_offset` in a
  // fenced destination, from CRC `initial`, and checks bytes, CRC and fences.
  void CheckCopy(size_t length, size_t source_offset, size_t destination_offset, uint32_t initial) {
    const std::vector<uint8_t> source = random_.Bytes(source_offset + length);
    std::vector<uint8_t> destination(kSlack + destination_offset + length + kSlack, kFence);
    uint8_t* to = destination.data() + kSlack + destination_offset;
    const uint32_t crc =
        CopyWithCrc32cUsing(GetParam(), to, source.data() + source_offset, length, initial);
    const std::string where = "length " + std::to_string(length) + ", source offset " +
                              std::to_string(source_offset) + ", destination offset " +
                              std::to_string(destination_offset);
    ASSERT_EQ(crc, Crc32cExtend(initial, source.data() + source_offset, length)) << where;
    ASSERT_EQ(std::memcmp(to, source.data() + source_offset, length), 0) << where;
    for (size_t at = 0; at < kSlack + destination_offset; ++at) {
      ASSERT_EQ(destination[at], kFence) << where << ": byte " << at << " before the copy";
    }
    for (size_t at = kSlack + destination_offset + length; at < destination.size(); ++at) {
      ASSERT_EQ(destination[at], kFence) << where << ": byte " << at << " after the copy";
    }
  }

  moesnap::testing::DeterministicBytes random_{20261126};
};

TEST_P(CopyCrc32cTest, EmptyAndTinyCopies) {
  EXPECT_EQ(CopyWithCrc32cUsing(GetParam(), nullptr, nullptr, 0, 0x1234u), 0x1234u);
  for (size_t length = 1; length <= 64; ++length) CheckCopy(length, length % 7, length % 13, 0);
  const std::string check = "123456789";
  std::string copy(check.size(), '\0');
  EXPECT_EQ(CopyWithCrc32cUsing(GetParam(), copy.data(), check.data(), check.size(), 0),
            0xe3069283u);
  EXPECT_EQ(copy, check);
}

TEST_P(CopyCrc32cTest, LengthsAroundBlockBoundaries) {
  // The interleaved kernel copies blocks of three 64 KiB lanes after a head that aligns the
  // destination to a cache line; CopyWithCrc32c switches kernels at one such block.
  constexpr size_t kBlock = 3 * 64 * 1024;
  for (size_t boundary : {kBlock, 2 * kBlock, size_t{1} << 20, (size_t{1} << 20) + kBlock}) {
    for (size_t delta : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{63},
                         size_t{64}, size_t{65}, size_t{4095}}) {
      for (size_t misalignment : {size_t{0}, size_t{1}, size_t{8}, size_t{33}, size_t{63}}) {
        ASSERT_NO_FATAL_FAILURE(CheckCopy(boundary + delta, misalignment, 63 - misalignment,
                                          static_cast<uint32_t>(boundary * 31 + delta)));
        ASSERT_NO_FATAL_FAILURE(CheckCopy(boundary - delta, misalignment, misalignment, 0));
      }
    }
  }
}

TEST_P(CopyCrc32cTest, RandomLengthsAndAlignments) {
  for (int trial = 0; trial < 200; ++trial) {
    // Half of them below one block of lanes, half up to 3 MiB.
    const size_t length = random_.Next() % (trial % 2 == 0 ? (3 << 20) : (96 << 10));
    ASSERT_NO_FATAL_FAILURE(CheckCopy(length, random_.Next() % 64, random_.Next() % 64,
                                      static_cast<uint32_t>(random_.Next())));
  }
}

TEST_P(CopyCrc32cTest, PiecesOfAChunkExtendItsCrc) {
  // A chunk split across pool extents is copied piece by piece, each extending the CRC.
  const std::vector<uint8_t> source = random_.Bytes(5 << 20);
  std::vector<uint8_t> destination(source.size());
  uint32_t crc = 0;
  size_t done = 0;
  while (done < source.size()) {
    const size_t piece = std::min<size_t>(1 + random_.Next() % (2 << 20), source.size() - done);
    crc = CopyWithCrc32cUsing(GetParam(), destination.data() + done, source.data() + done, piece,
                              crc);
    done += piece;
  }
  EXPECT_EQ(crc, Crc32c(source.data(), source.size()));
  EXPECT_EQ(destination, source);
}

TEST_P(CopyCrc32cTest, ASourceRewrittenDuringTheCopyGivesTheCrcOfTheBytesStored) {
  // A trainer may write its tensors while the daemon copies them: whatever mix of old and new bytes
  // lands, the CRC returned must be theirs, never that of other bytes. Copies are repeated until 20
  // of them ran while the writer wrote.
  constexpr size_t kLength = 4 << 20;
  std::vector<uint8_t> source = random_.Bytes(kLength);
  std::vector<uint8_t> destination(kLength);
  std::atomic<bool> done{false};
  std::atomic<uint64_t> writes{0};
  std::thread writer([&] {
    volatile uint8_t* const bytes = source.data();
    uint64_t position = 0;
    while (!done.load(std::memory_order_relaxed)) {
      position = position * 6364136223846793005ULL + 1442695040888963407ULL;
      const size_t at = (position >> 20) % kLength;
      bytes[at] = static_cast<uint8_t>(bytes[at] + 1);
      writes.fetch_add(1, std::memory_order_relaxed);
    }
  });
  int rewritten = 0;
  std::string mismatch;
  for (int round = 0; rewritten < 20 && mismatch.empty(); ++round) {
    const uint64_t before = writes.load();
    const uint32_t crc =
        CopyWithCrc32cUsing(GetParam(), destination.data(), source.data(), kLength, 0);
    if (writes.load() != before) ++rewritten;
    const uint32_t stored = Crc32c(destination.data(), kLength);
    if (crc != stored) {
      mismatch = "round " + std::to_string(round) + ": CRC " + std::to_string(crc) +
                 ", bytes stored " + std::to_string(stored);
    }
  }
  done = true;
  writer.join();
  EXPECT_EQ(mismatch, "");
}

INSTANTIATE_TEST_SUITE_P(Kernels, CopyCrc32cTest,
                         ::testing::Values(CopyCrcKernel::kInterleaved,
                                           CopyCrcKernel::kInterleavedWide,
                                           CopyCrcKernel::kBlocked),
                         [](const ::testing::TestParamInfo<CopyCrcKernel>& kernel) {
                           return KernelName(kernel.param);
                         });

TEST(CopyCrc32cDispatchTest, EitherSideOfTheKernelSwitchGivesTheSameBytesAndCrc) {
  moesnap::testing::DeterministicBytes random(5);
  for (size_t length : {size_t{100000}, size_t{3 * 64 * 1024 - 1}, size_t{3 * 64 * 1024},
                        size_t{3000017}}) {
    const std::vector<uint8_t> source = random.Bytes(length);
    std::vector<uint8_t> destination(length);
    EXPECT_EQ(CopyWithCrc32c(destination.data(), source.data(), length, 7),
              Crc32cExtend(7, source.data(), length))
        << length;
    EXPECT_EQ(destination, source) << length;
  }
#if defined(__x86_64__)
  EXPECT_EQ(CopyCrcKernelAvailable(CopyCrcKernel::kInterleaved),
            __builtin_cpu_supports("sse4.2") != 0);
  EXPECT_EQ(CopyCrcKernelAvailable(CopyCrcKernel::kInterleavedWide),
            __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("avx512f") &&
                __builtin_cpu_supports("avx512dq"));
  if (__builtin_cpu_supports("sse4.2")) {
    EXPECT_TRUE(CopyCrcKernelAvailable(OnePassKernel())) << KernelName(OnePassKernel());
  }
#endif
  EXPECT_TRUE(CopyCrcKernelAvailable(CopyCrcKernel::kBlocked));
}

}  // namespace
}  // namespace moesnap::erasure
