// CRC-32C over ISA-L. crc32_iscsi neither pre- nor post-inverts and takes an int length, so this
// file adds the standard inversions and feeds lengths beyond INT_MAX in pieces.
#include "erasure/crc32c.h"
#include "erasure/crc32c_shift.h"

#include <isa-l/crc.h>

#include <algorithm>

namespace moesnap::erasure {
namespace {
constexpr size_t kMaxPieceBytes = size_t{1} << 30;
}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t length) {
  auto* bytes = static_cast<unsigned char*>(const_cast<void*>(data));  // ISA-L only reads
  uint32_t state = ~crc;
  while (length > 0) {
    const size_t piece = std::min(length, kMaxPieceBytes);
    state = crc32_iscsi(bytes, static_cast<int>(piece), state);
    bytes += piece;
    length -= piece;
  }
  return ~state;
}

uint32_t Crc32c(const void* data, size_t length) { return Crc32cExtend(0, data, length); }

// With the inversions, Crc32c(a b) = ~R(~0, a b) for the raw register R, which is linear in its
// start: R(s, b) = Z(s) ^ R(0, b) for Z the shift over |b| zero bytes. Expanding both sides,
// the inversions cancel to Crc32c(a b) = Z(Crc32c(a)) ^ Crc32c(b).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return internal::ShiftOverZeros(crc_a, length_b) ^ crc_b;
}

}  // namespace moesnap::erasure
