// Fuzzes the data plane's frame decoder: any bytes as a header (and what follows as the payload)
// are either refused with a status or give a header whose every bound holds; the payload of a
// region request is either refused or names regions within a request's bounds, and encodes back to
// the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "daemon/frame.h"

namespace {

constexpr uint32_t kMaxPayload = 1 << 20;

void Require(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using moesnap::daemon::FrameHeader;
  if (size < FrameHeader::kBytes) {
    Require(!moesnap::daemon::DecodeFrameHeader({data, size}, kMaxPayload).ok());
    return 0;
  }
  absl::StatusOr<FrameHeader> header =
      moesnap::daemon::DecodeFrameHeader({data, FrameHeader::kBytes}, kMaxPayload);
  if (!header.ok()) return 0;
  Require(header->length <= kMaxPayload);
  Require(header->region.size() <= FrameHeader::kMaxRegionBytes);
  // A decoded header encodes back to the same bytes.
  uint8_t again[FrameHeader::kBytes];
  moesnap::daemon::EncodeFrameHeader(*header, again);
  for (size_t i = 0; i < FrameHeader::kBytes; ++i) Require(again[i] == data[i]);
  const absl::Span<const uint8_t> payload(data + FrameHeader::kBytes, size - FrameHeader::kBytes);
  (void)moesnap::daemon::CheckFramePayload(*header, payload);
  if (header->kind != moesnap::daemon::FrameKind::kRegionRequest) return 0;
  absl::StatusOr<moesnap::daemon::RegionRequest> request =
      moesnap::daemon::DecodeRegionRequest(payload);
  if (!request.ok()) return 0;
  Require(!request->regions.empty());
  Require(request->regions.size() <= moesnap::daemon::RegionRequest::kMaxRegions);
  std::vector<absl::string_view> names;
  for (const std::string& region : request->regions) {
    Require(!region.empty() && region.size() <= FrameHeader::kMaxRegionBytes);
    names.push_back(region);
  }
  absl::StatusOr<std::vector<uint8_t>> encoded =
      moesnap::daemon::EncodeRegionRequest(request->asking, names);
  Require(encoded.ok() && encoded->size() == payload.size());
  for (size_t i = 0; i < payload.size(); ++i) Require((*encoded)[i] == payload[i]);
  return 0;
}
