// Frame header encoding and validation.
#include "daemon/frame.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {
namespace {

template <typename T>
void Put(uint8_t* out, size_t offset, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) out[offset + i] = static_cast<uint8_t>(uint64_t(value) >> (8 * i));
}

template <typename T>
T Get(const uint8_t* in, size_t offset) {
  uint64_t value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) value |= uint64_t{in[offset + i]} << (8 * i);
  return static_cast<T>(value);
}

constexpr size_t kHeaderCrcOffset = 60;

}  // namespace

void EncodeFrameHeader(const FrameHeader& header, uint8_t out[FrameHeader::kBytes]) {
  std::memset(out, 0, FrameHeader::kBytes);
  Put<uint32_t>(out, 0, FrameHeader::kMagic);
  Put<uint16_t>(out, 4, FrameHeader::kVersion);
  Put<uint16_t>(out, 6, static_cast<uint16_t>(header.kind));
  Put<int64_t>(out, 8, header.step);
  Put<uint32_t>(out, 16, header.rank);
  Put<uint32_t>(out, 20, header.stripe_unit);
  Put<uint64_t>(out, 24, header.stripe);
  Put<uint64_t>(out, 32, header.offset);
  Put<uint32_t>(out, 40, header.length);
  Put<uint32_t>(out, 44, header.payload_crc);
  Put<uint16_t>(out, 48, static_cast<uint16_t>(header.region.size()));
  Put<int64_t>(out, 52, header.attempt);
  Put<uint32_t>(out, kHeaderCrcOffset, erasure::Crc32c(out, kHeaderCrcOffset));
}

absl::StatusOr<FrameHeader> DecodeFrameHeader(absl::Span<const uint8_t> bytes, uint32_t max_payload) {
  if (bytes.size() != FrameHeader::kBytes) {
    return absl::InvalidArgumentError(absl::StrCat("frame header is ", FrameHeader::kBytes,
                                                   " bytes, got ", bytes.size()));
  }
  const uint8_t* in = bytes.data();
  if (const uint32_t magic = Get<uint32_t>(in, 0); magic != FrameHeader::kMagic) {
    return absl::InvalidArgumentError(absl::StrFormat("bad frame magic %08x", magic));
  }
  if (const uint16_t version = Get<uint16_t>(in, 4); version != FrameHeader::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported frame version ", version,
                                                   " (this daemon speaks ", FrameHeader::kVersion, ")"));
  }
  const uint32_t expected_crc = Get<uint32_t>(in, kHeaderCrcOffset);
  if (const uint32_t actual = erasure::Crc32c(in, kHeaderCrcOffset); actual != expected_crc) {
    return absl::DataLossError(absl::StrFormat("frame header CRC-32C is %08x, the header says %08x",
                                               actual, expected_crc));
  }
  FrameHeader header;
  const uint16_t kind = Get<uint16_t>(in, 6);
  if (kind < static_cast<uint16_t>(FrameKind::kParityDelta) ||
      kind > static_cast<uint16_t>(FrameKind::kRegionRefused)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown frame kind ", kind));
  }
  header.kind = static_cast<FrameKind>(kind);
  header.step = Get<int64_t>(in, 8);
  header.rank = Get<uint32_t>(in, 16);
  header.stripe_unit = Get<uint32_t>(in, 20);
  header.stripe = Get<uint64_t>(in, 24);
  header.offset = Get<uint64_t>(in, 32);
  header.length = Get<uint32_t>(in, 40);
  header.payload_crc = Get<uint32_t>(in, 44);
  const uint16_t region_bytes = Get<uint16_t>(in, 48);
  if (const uint16_t reserved = Get<uint16_t>(in, 50); reserved != 0) {
    return absl::InvalidArgumentError(absl::StrCat("frame reserved field is ", reserved,
                                                   ", not zero"));
  }
  header.attempt = Get<int64_t>(in, 52);
  if (header.length > max_payload) {
    return absl::InvalidArgumentError(absl::StrCat("frame payload of ", header.length,
                                                   " bytes exceeds the limit of ", max_payload));
  }
  if (region_bytes > FrameHeader::kMaxRegionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("frame region name of ", region_bytes,
                                                   " bytes exceeds the limit of ",
                                                   FrameHeader::kMaxRegionBytes));
  }
  header.region.resize(region_bytes);  // filled by the reader from the bytes after the header
  return header;
}

absl::Status SealFrame(FrameHeader& header, absl::Span<const absl::Span<const uint8_t>> pieces) {
  uint64_t length = 0;
  uint32_t crc = 0;
  for (absl::Span<const uint8_t> piece : pieces) {
    length += piece.size();
    crc = erasure::Crc32cExtend(crc, piece.data(), piece.size());
  }
  if (length > UINT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("a frame payload of ", length, " bytes does not fit the frame format"));
  }
  header.length = static_cast<uint32_t>(length);
  header.payload_crc = crc;
  return absl::OkStatus();
}

absl::Status CheckFramePayload(const FrameHeader& header, absl::Span<const uint8_t> payload) {
  // A payload of another length fails on that; its CRC is not needed.
  const uint32_t crc =
      payload.size() == header.length ? erasure::Crc32c(payload.data(), payload.size()) : 0;
  return CheckFramePayloadCrc(header, payload.size(), crc);
}

absl::Status CheckFramePayloadCrc(const FrameHeader& header, uint64_t length, uint32_t crc) {
  if (length != header.length) {
    return absl::DataLossError(absl::StrCat("frame payload is ", length, " bytes, the header says ",
                                            header.length));
  }
  if (crc != header.payload_crc) {
    return absl::DataLossError(absl::StrFormat(
        "payload CRC-32C of step %d stripe %d unit %d is %08x, the frame says %08x", header.step,
        header.stripe, header.stripe_unit, crc, header.payload_crc));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> EncodeRegionRequest(
    uint32_t asking, absl::Span<const absl::string_view> regions) {
  if (regions.empty() || regions.size() > RegionRequest::kMaxRegions) {
    return absl::InvalidArgumentError(absl::StrCat("a region request names 1 to ",
                                                   RegionRequest::kMaxRegions, " regions, not ",
                                                   regions.size()));
  }
  size_t bytes = 6;
  for (absl::string_view region : regions) {
    if (region.empty() || region.size() > FrameHeader::kMaxRegionBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a region request names regions of 1 to ", FrameHeader::kMaxRegionBytes,
          " bytes, not one of ", region.size()));
    }
    bytes += 2 + region.size();
  }
  std::vector<uint8_t> payload(bytes);
  Put<uint32_t>(payload.data(), 0, asking);
  Put<uint16_t>(payload.data(), 4, static_cast<uint16_t>(regions.size()));
  size_t at = 6;
  for (absl::string_view region : regions) {
    Put<uint16_t>(payload.data(), at, static_cast<uint16_t>(region.size()));
    std::memcpy(payload.data() + at + 2, region.data(), region.size());
    at += 2 + region.size();
  }
  return payload;
}

absl::StatusOr<RegionRequest> DecodeRegionRequest(absl::Span<const uint8_t> payload) {
  if (payload.size() < 6) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a region request of ", payload.size(), " bytes is shorter than its 6 fixed bytes"));
  }
  RegionRequest request;
  request.asking = Get<uint32_t>(payload.data(), 0);
  const uint16_t count = Get<uint16_t>(payload.data(), 4);
  if (count == 0 || count > RegionRequest::kMaxRegions) {
    return absl::InvalidArgumentError(absl::StrCat("a region request names 1 to ",
                                                   RegionRequest::kMaxRegions, " regions, not ",
                                                   count));
  }
  size_t at = 6;
  for (uint16_t i = 0; i < count; ++i) {
    if (payload.size() - at < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("a region request ends within the length of region ", i));
    }
    const uint16_t bytes = Get<uint16_t>(payload.data(), at);
    at += 2;
    if (bytes == 0 || bytes > FrameHeader::kMaxRegionBytes || bytes > payload.size() - at) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region ", i, " of a region request is ", bytes, " bytes long, with ",
          payload.size() - at, " left (names are 1 to ", FrameHeader::kMaxRegionBytes, ")"));
    }
    std::string region(reinterpret_cast<const char*>(payload.data() + at), bytes);
    at += bytes;
    for (const std::string& before : request.regions) {
      if (before == region) {
        return absl::InvalidArgumentError(
            absl::StrCat("a region request names region '", region, "' twice"));
      }
    }
    request.regions.push_back(std::move(region));
  }
  if (at != payload.size()) {
    return absl::InvalidArgumentError(absl::StrCat("a region request has ", payload.size() - at,
                                                   " bytes after its last region"));
  }
  return request;
}

}  // namespace moesnap::daemon
