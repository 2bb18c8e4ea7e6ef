// The bulk data plane's wire format: every chunk that crosses between daemons (parity units, parity
// deltas of sparse steps, units fetched for a rebuild, regions fetched for an elastic restore and
// the requests for them) travels as one frame, a fixed 64-byte header, the region name, then the
// payload:
//
//   offset size field
//   0      4    magic "MSDP"            32     8    offset   byte offset within the unit
//   4      2    version (5)             40     4    length   payload bytes
//   6      2    kind (FrameKind)        44     4    payload_crc   CRC-32C of the payload
//   8      8    step                    48     2    region_bytes  length of the region name
//   16     4    rank                    50     2    reserved, zero
//   20     4    stripe_unit (index in stripe)   52     8    attempt   encode or request token
//   24     8    stripe                  60     4    header_crc  CRC-32C of bytes 0..59
//
// `attempt` is the fencing token of the coordinator whose Encode sent a parity delta: a step encoded
// again under a newer coordinator drops the frames an older one's encode still had on the wire. In
// a region request, and in the frames and refusal that answer it, and in the frames of units sent
// for a SendUnits or DecodeUnits call, it is the asking node's request token, by which that node
// tells the answers it awaits from late ones.
//
// The version changes with the meaning of any frame, so that daemons of different versions refuse
// each other's frames (a step aborts, saying why) instead of misreading them. 3: a parity delta of a
// fresh stripe carries the unit itself, and region requests and refusals (kinds 5 and 6) exist.
// 4: a region request names up to RegionRequest::kMaxRegions regions in its payload. 5: a fetched
// unit's frame carries the request token of the SendUnits or DecodeUnits call it answers in
// `attempt`, as a fetched region's does.
//
// All integers little-endian. A frame is accepted only if magic, version, kind, the reserved field
// (zero), every length bound and both CRCs hold; anything else is rejected with the reason and the
// connection is closed, so a malformed or truncated frame can never reach stored data. One
// exception: the payload of a region fetched for an elastic restore is checked by the restoring
// node against the region's stored chunk CRCs as it writes it into the rank, not against the
// frame's CRC as it lands; its holder sends each chunk that fits a frame as one frame carrying the
// chunk's stored CRC-32C, so neither end passes over the bytes for the frame's sake.
#ifndef MOESNAP_DAEMON_FRAME_H_
#define MOESNAP_DAEMON_FRAME_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace moesnap::daemon {

enum class FrameKind : uint16_t {
  // 1 is retired (whole parity units are never sent: holders build their own).
  // A data unit's change for a parity holder, old XOR new bytes (the unit itself when the holder
  // starts from zero parity: a full encode, or a fresh stripe of StepChanges); the holder adds
  // coefficient * delta to its parity unit.
  kParityDelta = 2,
  kFetchedUnit = 3,    // a data or parity unit served to a rebuilding or repairing peer
  kFetchedRegion = 4,  // a chunk of a committed region served for an elastic restore
  // An elastic restore asks the receiver for regions of rank `rank` of its committed step `step`,
  // named in the payload (RegionRequest; the frame's own region name is empty). The receiver
  // answers on its own connection to that node, region after region in the order named: each
  // region's kFetchedRegion frames, or one kRegionRefused.
  kRegionRequest = 5,
  // The holder cannot send a region asked for (step, rank and region as asked); the payload says
  // why, in text.
  kRegionRefused = 6,
};

struct FrameHeader {
  static constexpr uint32_t kMagic = 0x5044534d;  // "MSDP" little-endian
  static constexpr uint16_t kVersion = 5;
  static constexpr size_t kBytes = 64;
  static constexpr size_t kMaxRegionBytes = 1024;

  FrameKind kind = FrameKind::kParityDelta;
  int64_t step = 0;
  uint32_t rank = 0;
  uint32_t stripe_unit = 0;
  uint64_t stripe = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
  uint32_t payload_crc = 0;
  int64_t attempt = 0;
  std::string region;
};

// Writes the 64-byte header (region name not included) for `header`.
void EncodeFrameHeader(const FrameHeader& header, uint8_t out[FrameHeader::kBytes]);

// Parses and checks a 64-byte header; the region name and payload follow on the wire. `max_payload`
// bounds `length` (the receiver's buffer). INVALID_ARGUMENT / DATA_LOSS name the field at fault.
absl::StatusOr<FrameHeader> DecodeFrameHeader(absl::Span<const uint8_t> bytes, uint32_t max_payload);

// Fills header.length and header.payload_crc from the payload `pieces`, one after another: sealed
// once, a frame may go to several peers. INVALID_ARGUMENT when it does not fit the frame format.
absl::Status SealFrame(FrameHeader& header, absl::Span<const absl::Span<const uint8_t>> pieces);

// Checks a received payload against the header's CRC.
absl::Status CheckFramePayload(const FrameHeader& header, absl::Span<const uint8_t> payload);
// The same for a payload of `length` bytes whose CRC-32C (`crc`) the receiver computed as it read
// it.
absl::Status CheckFramePayloadCrc(const FrameHeader& header, uint64_t length, uint32_t crc);

// The payload of a kRegionRequest: the asking node's id (4 bytes), the number of regions (2), then
// each region's name as its length (2) and its bytes. One request names 1 to kMaxRegions distinct
// regions, each name 1 to FrameHeader::kMaxRegionBytes bytes long. The regions of a request naming
// more than one hold at most kMaxBytes together; the holder refuses those past that bound.
struct RegionRequest {
  static constexpr size_t kMaxRegions = 16;
  static constexpr uint64_t kMaxBytes = 1 << 20;
  uint32_t asking = 0;
  std::vector<std::string> regions;
};
// INVALID_ARGUMENT when `regions` break the bounds above.
absl::StatusOr<std::vector<uint8_t>> EncodeRegionRequest(
    uint32_t asking, absl::Span<const absl::string_view> regions);
// INVALID_ARGUMENT, naming the fault, when `payload` is not one RegionRequest within its bounds.
absl::StatusOr<RegionRequest> DecodeRegionRequest(absl::Span<const uint8_t> payload);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_FRAME_H_
