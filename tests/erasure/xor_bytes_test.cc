// XorInto and XorOf against a byte-by-byte XOR, at every alignment of the buffers and lengths
// around the vector size, and never a byte outside the range.
#include "erasure/xor_bytes.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

namespace moesnap::erasure {
namespace {

TEST(XorBytesTest, MatchesAByteLoopAtEveryAlignmentAndLength) {
  std::mt19937 random(7);
  std::vector<uint8_t> in(4096 + 64), out(4096 + 64);
  for (uint8_t& byte : in) byte = static_cast<uint8_t>(random());
  for (size_t length : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{63},
                        size_t{64}, size_t{65}, size_t{1000}, size_t{4096}}) {
    for (size_t out_at = 0; out_at < 8; ++out_at) {
      for (size_t in_at = 0; in_at < 8; ++in_at) {
        for (uint8_t& byte : out) byte = static_cast<uint8_t>(random());
        std::vector<uint8_t> expected = out;
        for (size_t i = 0; i < length; ++i) expected[out_at + i] ^= in[in_at + i];
        XorInto(out.data() + out_at, in.data() + in_at, length);
        ASSERT_EQ(out, expected) << "length " << length << ", out at " << out_at << ", in at "
                                 << in_at;
      }
    }
  }
}

TEST(XorBytesTest, XorOfMatchesAByteLoopAtEveryAlignmentAndLength) {
  std::mt19937 random(5);
  std::vector<uint8_t> a(4096 + 64), b(4096 + 64), out(4096 + 64);
  for (uint8_t& byte : a) byte = static_cast<uint8_t>(random());
  for (uint8_t& byte : b) byte = static_cast<uint8_t>(random());
  for (size_t length : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{63},
                        size_t{64}, size_t{65}, size_t{1000}, size_t{4096}}) {
    for (size_t out_at = 0; out_at < 8; ++out_at) {
      for (size_t a_at : {size_t{0}, size_t{3}, size_t{7}}) {
        for (size_t b_at : {size_t{0}, size_t{1}, size_t{5}}) {
          for (uint8_t& byte : out) byte = static_cast<uint8_t>(random());
          std::vector<uint8_t> expected = out;
          for (size_t i = 0; i < length; ++i) expected[out_at + i] = a[a_at + i] ^ b[b_at + i];
          XorOf(out.data() + out_at, a.data() + a_at, b.data() + b_at, length);
          ASSERT_EQ(out, expected) << "length " << length << ", out at " << out_at << ", a at "
                                   << a_at << ", b at " << b_at;
        }
      }
    }
  }
}

TEST(XorBytesTest, XoringTwiceGivesBackTheOriginal) {
  std::vector<uint8_t> data(1 << 20), delta(1 << 20);
  std::mt19937 random(11);
  for (uint8_t& byte : data) byte = static_cast<uint8_t>(random());
  for (uint8_t& byte : delta) byte = static_cast<uint8_t>(random());
  const std::vector<uint8_t> original = data;
  XorInto(data.data(), delta.data(), data.size());
  EXPECT_NE(data, original);
  XorInto(data.data(), delta.data(), data.size());
  EXPECT_EQ(data, original);
}

}  // namespace
}  // namespace moesnap::erasure
