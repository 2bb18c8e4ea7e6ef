// Fuzzes the data plane's frame decoder: any bytes as a header (and what follows as the payload)
// are either refused with a status or give a header whose every bound holds.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

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
  return 0;
}
