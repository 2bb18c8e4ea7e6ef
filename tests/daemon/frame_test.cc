// The data plane's frame header: round trip, and every malformed header or payload rejected with the
// field at fault named.
#include "daemon/frame.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "erasure/crc32c.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

FrameHeader Sample(const std::vector<uint8_t>& payload) {
  FrameHeader header;
  header.kind = FrameKind::kParityDelta;
  header.step = 1234567890123;
  header.rank = 7;
  header.stripe_unit = 3;
  header.stripe = 99;
  header.offset = 4096;
  header.length = static_cast<uint32_t>(payload.size());
  header.payload_crc = erasure::Crc32c(payload.data(), payload.size());
  header.attempt = 0x0102030405060708;
  header.region = "layer3.expert17.master";
  return header;
}

TEST(FrameTest, RoundTripsEveryField) {
  const std::vector<uint8_t> payload(5000, 0x42);
  const FrameHeader sent = Sample(payload);
  uint8_t bytes[FrameHeader::kBytes];
  EncodeFrameHeader(sent, bytes);
  absl::StatusOr<FrameHeader> received = DecodeFrameHeader(bytes, 1 << 20);
  ASSERT_OK(received);
  EXPECT_EQ(received->kind, sent.kind);
  EXPECT_EQ(received->step, sent.step);
  EXPECT_EQ(received->rank, sent.rank);
  EXPECT_EQ(received->stripe_unit, sent.stripe_unit);
  EXPECT_EQ(received->stripe, sent.stripe);
  EXPECT_EQ(received->offset, sent.offset);
  EXPECT_EQ(received->length, sent.length);
  EXPECT_EQ(received->attempt, sent.attempt);
  EXPECT_EQ(received->region.size(), sent.region.size());
  EXPECT_OK(CheckFramePayload(*received, payload));
}

TEST(FrameTest, EveryCorruptionIsRejectedByName) {
  const std::vector<uint8_t> payload(100, 1);
  uint8_t good[FrameHeader::kBytes];
  EncodeFrameHeader(Sample(payload), good);

  auto decode_with = [&](size_t byte, uint8_t value) {
    uint8_t bytes[FrameHeader::kBytes];
    std::copy(good, good + FrameHeader::kBytes, bytes);
    bytes[byte] = value;
    return DecodeFrameHeader(bytes, 1 << 20).status();
  };
  EXPECT_TRUE(absl::StrContains(decode_with(0, 'X').message(), "magic"));
  EXPECT_TRUE(absl::StrContains(decode_with(4, 9).message(), "version 9"));
  // Version 2 would read a fresh stripe's units as deltas: its frames are refused.
  EXPECT_TRUE(absl::StrContains(decode_with(4, 2).message(), "version 2"));
  EXPECT_TRUE(absl::StrContains(decode_with(17, 1).message(), "header CRC"));  // a flipped rank bit
  EXPECT_STATUS(decode_with(17, 1), absl::StatusCode::kDataLoss);
  // Every single-bit flip anywhere in the header is caught.
  for (size_t bit = 0; bit < FrameHeader::kBytes * 8; ++bit) {
    uint8_t bytes[FrameHeader::kBytes];
    std::copy(good, good + FrameHeader::kBytes, bytes);
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    EXPECT_FALSE(DecodeFrameHeader(bytes, 1 << 20).ok()) << "bit " << bit;
  }
  EXPECT_STATUS(DecodeFrameHeader(absl::MakeConstSpan(good, 63), 1 << 20),
                absl::StatusCode::kInvalidArgument);
  absl::Status too_long = DecodeFrameHeader(good, 50).status();
  EXPECT_TRUE(absl::StrContains(too_long.message(), "exceeds the limit of 50")) << too_long;

  absl::StatusOr<FrameHeader> header = DecodeFrameHeader(good, 1 << 20);
  ASSERT_OK(header);
  std::vector<uint8_t> damaged = payload;
  damaged[50] ^= 4;
  EXPECT_STATUS(CheckFramePayload(*header, damaged), absl::StatusCode::kDataLoss);
  EXPECT_STATUS(CheckFramePayload(*header, absl::MakeConstSpan(payload).subspan(1)),
                absl::StatusCode::kDataLoss);
}

// Found by the frame fuzzer: a header with a non-zero reserved field (and a matching header CRC)
// was accepted, so it did not encode back to the bytes it came from.
TEST(FrameTest, ANonZeroReservedFieldIsRejected) {
  uint8_t bytes[FrameHeader::kBytes];
  EncodeFrameHeader(Sample({}), bytes);
  bytes[51] = 0x80;
  const uint32_t crc = erasure::Crc32c(bytes, 60);
  for (size_t i = 0; i < 4; ++i) bytes[60 + i] = static_cast<uint8_t>(crc >> (8 * i));
  const absl::Status status = DecodeFrameHeader(bytes, 1 << 20).status();
  EXPECT_STATUS(status, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "reserved field is 32768")) << status;
}

TEST(FrameTest, KindAndRegionLengthAreBounded) {
  FrameHeader header = Sample({});
  header.region = std::string(FrameHeader::kMaxRegionBytes + 1, 'r');
  uint8_t bytes[FrameHeader::kBytes];
  EncodeFrameHeader(header, bytes);
  EXPECT_TRUE(absl::StrContains(DecodeFrameHeader(bytes, 1 << 20).status().message(), "region name"));
  header.region = "r";
  header.kind = static_cast<FrameKind>(77);
  EncodeFrameHeader(header, bytes);
  EXPECT_TRUE(absl::StrContains(DecodeFrameHeader(bytes, 1 << 20).status().message(), "kind 77"));
}

TEST(FrameTest, ARegionRequestRoundTrips) {
  const std::string longest(FrameHeader::kMaxRegionBytes, 'n');
  const std::vector<absl::string_view> names = {"layer0.weight", longest, "x"};
  const absl::StatusOr<std::vector<uint8_t>> payload = EncodeRegionRequest(0x01020304, names);
  ASSERT_OK(payload);
  EXPECT_EQ(payload->size(), 6 + 3 * 2 + 13 + longest.size() + 1);
  const absl::StatusOr<RegionRequest> request = DecodeRegionRequest(*payload);
  ASSERT_OK(request);
  EXPECT_EQ(request->asking, 0x01020304u);
  EXPECT_EQ(request->regions, std::vector<std::string>(names.begin(), names.end()));

  std::vector<std::string> distinct;
  for (size_t i = 0; i < RegionRequest::kMaxRegions; ++i) distinct.push_back(absl::StrCat("r", i));
  const std::vector<absl::string_view> full(distinct.begin(), distinct.end());
  const absl::StatusOr<std::vector<uint8_t>> full_payload = EncodeRegionRequest(0, full);
  ASSERT_OK(full_payload);
  EXPECT_OK(DecodeRegionRequest(*full_payload));
}

// What the sender refuses to encode, and every malformed payload, by name.
TEST(FrameTest, ARegionRequestOutsideItsBoundsIsRejectedByName) {
  const std::string too_long(FrameHeader::kMaxRegionBytes + 1, 'n');
  for (const std::vector<absl::string_view>& names :
       {std::vector<absl::string_view>{}, std::vector<absl::string_view>{""},
        std::vector<absl::string_view>{too_long},
        std::vector<absl::string_view>(RegionRequest::kMaxRegions + 1, "r")}) {
    EXPECT_STATUS(EncodeRegionRequest(0, names).status(), absl::StatusCode::kInvalidArgument)
        << names.size() << " names";
  }
  const absl::StatusOr<std::vector<uint8_t>> good = EncodeRegionRequest(7, {"ab", "cd"});
  ASSERT_OK(good);
  auto rejected = [](std::vector<uint8_t> payload, absl::string_view why) {
    const absl::Status status = DecodeRegionRequest(payload).status();
    EXPECT_STATUS(status, absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(status.message(), why)) << status << " is not about " << why;
  };
  rejected({7, 0, 0, 0, 1}, "shorter than its 6 fixed bytes");
  std::vector<uint8_t> bad = *good;
  bad[4] = 0;
  rejected(bad, "names 1 to 16 regions, not 0");
  bad[4] = RegionRequest::kMaxRegions + 1;
  rejected(bad, "not 17");
  bad = *good;
  bad[4] = 3;
  rejected(bad, "ends within the length of region 2");
  bad = *good;
  bad[6] = 0;
  rejected(bad, "region 0 of a region request is 0 bytes long");
  bad[6] = 7;
  rejected(bad, "region 0 of a region request is 7 bytes long, with 6 left");
  bad = *good;
  bad.push_back(0);
  rejected(bad, "1 bytes after its last region");
  bad = *good;
  bad[12] = 'a';
  bad[13] = 'b';
  rejected(bad, "names region 'ab' twice");
  // A name longer than a region name may be, though the payload holds it.
  bad = {0, 0, 0, 0, 1, 0};
  const uint16_t length = FrameHeader::kMaxRegionBytes + 1;
  bad.push_back(static_cast<uint8_t>(length));
  bad.push_back(static_cast<uint8_t>(length >> 8));
  bad.resize(bad.size() + length, 'n');
  rejected(bad, "1025 bytes long");
}

}  // namespace
}  // namespace moesnap::daemon
