// CRC-32C over ISA-L. crc32_iscsi neither pre- nor post-inverts and takes an int length, so this
// file adds the standard inversions and feeds lengths beyond INT_MAX in pieces.
#include "erasure/crc32c.h"

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

}  // namespace moesnap::erasure
