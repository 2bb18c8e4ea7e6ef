// Crc32c against the published test vectors (RFC 3720, appendix B.4) and the streaming contract.
#include "erasure/crc32c.h"
#include "erasure/crc32c_shift.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "tests/testing/deterministic_bytes.h"

namespace moesnap::erasure {
namespace {

TEST(Crc32cTest, Rfc3720Vectors) {
  std::vector<uint8_t> zeros(32, 0x00);
  std::vector<uint8_t> ones(32, 0xff);
  std::vector<uint8_t> ascending(32);
  std::iota(ascending.begin(), ascending.end(), 0);
  std::vector<uint8_t> descending(ascending.rbegin(), ascending.rend());
  // An iSCSI read command PDU (48 bytes), RFC 3720 B.4.
  std::vector<uint8_t> read_command = {
      0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
      0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00,
      0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00,
      0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};

  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8a9136aau);
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62a8ab43u);
  EXPECT_EQ(Crc32c(ascending.data(), ascending.size()), 0x46dd794eu);
  EXPECT_EQ(Crc32c(descending.data(), descending.size()), 0x113fdb5cu);
  EXPECT_EQ(Crc32c(read_command.data(), read_command.size()), 0xd9963a56u);
}

TEST(Crc32cTest, CheckValueAndEmptyInput) {
  const std::string check = "123456789";
  EXPECT_EQ(Crc32c(check.data(), check.size()), 0xe3069283u);
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
  EXPECT_EQ(Crc32cExtend(0x12345678u, nullptr, 0), 0x12345678u);
}

TEST(Crc32cTest, ExtendingPieceByPieceEqualsOneCall) {
  moesnap::testing::DeterministicBytes random(42);
  const std::vector<uint8_t> bytes = random.Bytes(1 << 20);
  const uint32_t whole = Crc32c(bytes.data(), bytes.size());
  for (int trial = 0; trial < 20; ++trial) {
    uint32_t crc = 0;
    size_t offset = 0;
    while (offset < bytes.size()) {
      const size_t piece = std::min<size_t>(1 + random.Next() % 70000, bytes.size() - offset);
      crc = Crc32cExtend(crc, bytes.data() + offset, piece);
      offset += piece;
    }
    ASSERT_EQ(crc, whole) << "trial " << trial;
  }
}

TEST(Crc32cTest, CombiningTheCrcsOfTwoPiecesEqualsTheCrcOfBoth) {
  moesnap::testing::DeterministicBytes random(11);
  const std::vector<uint8_t> bytes = random.Bytes(3 << 20);
  // Lengths of every shape: none, one byte, powers of two, and sums of many powers of two.
  const std::vector<size_t> lengths = {0, 1, 3, 4096, 65536, 65536 + 4096 + 7, 1 << 20,
                                       (3 << 20) - 1};
  for (size_t first : {size_t{0}, size_t{5}, size_t{4096}}) {
    for (size_t second : lengths) {
      if (first + second > bytes.size()) continue;
      const uint32_t a = Crc32c(bytes.data(), first);
      const uint32_t b = Crc32c(bytes.data() + first, second);
      ASSERT_EQ(Crc32cCombine(a, b, second), Crc32c(bytes.data(), first + second))
          << first << " then " << second << " bytes";
    }
  }
}

TEST(Crc32cTest, CombiningManyPiecesInOrderEqualsOneCrc) {
  moesnap::testing::DeterministicBytes random(12);
  const std::vector<uint8_t> bytes = random.Bytes(1 << 20);
  uint32_t combined = 0;
  size_t offset = 0;
  while (offset < bytes.size()) {
    const size_t piece = std::min<size_t>(random.Next() % 9000, bytes.size() - offset);
    combined = Crc32cCombine(combined, Crc32c(bytes.data() + offset, piece), piece);
    offset += piece;
  }
  EXPECT_EQ(combined, Crc32c(bytes.data(), bytes.size()));
}

// Crc32cCombine shifts by carry-less multiplication where the CPU has it: the same shift as the
// portable map at every length, far past any that can be checked against real bytes.
TEST(Crc32cTest, CombiningShiftsAsThePortableMapAtEveryLength) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("sse4.2") || !__builtin_cpu_supports("pclmul")) {
    GTEST_SKIP() << "this CPU has no carry-less multiplication: Crc32cCombine is the portable map";
  }
#else
  GTEST_SKIP() << "Crc32cCombine shifts by carry-less multiplication on x86-64 alone";
#endif
  moesnap::testing::DeterministicBytes random(13);
  std::vector<uint64_t> lengths;
  for (uint64_t length = 0; length < 300; ++length) lengths.push_back(length);
  for (int power = 3; power < 64; ++power) {
    const uint64_t two_to_the = uint64_t{1} << power;
    lengths.insert(lengths.end(), {two_to_the - 1, two_to_the, two_to_the + 5});
  }
  for (int trial = 0; trial < 200; ++trial) lengths.push_back(random.Next());
  for (const uint64_t length : lengths) {
    for (int state = 0; state < 8; ++state) {
      const auto crc = static_cast<uint32_t>(random.Next());
      ASSERT_EQ(Crc32cCombine(crc, 0, length), internal::ShiftOverZeros(crc, length))
          << "register " << crc << " over " << length << " zero bytes";
    }
  }
}

TEST(Crc32cTest, DetectsEverySingleBitFlip) {
  moesnap::testing::DeterministicBytes random(7);
  std::vector<uint8_t> bytes = random.Bytes(4096);
  const uint32_t clean = Crc32c(bytes.data(), bytes.size());
  for (size_t bit = 0; bit < bytes.size() * 8; bit += 13) {
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    ASSERT_NE(Crc32c(bytes.data(), bytes.size()), clean) << "bit " << bit;
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
  }
}

}  // namespace
}  // namespace moesnap::erasure
