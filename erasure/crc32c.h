// CRC-32C (Castagnoli, the iSCSI polynomial 0x1EDC6F41) over Intel ISA-L's crc32_iscsi.
// Every stored or transmitted chunk carries one; it is computed while the bytes are in cache.
#ifndef MOESNAP_ERASURE_CRC32C_H_
#define MOESNAP_ERASURE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace moesnap::erasure {

// The standard CRC-32C of `length` bytes (initial value and final XOR 0xFFFFFFFF, reflected), the
// value RFC 3720 and every other CRC-32C implementation give: Crc32c("123456789") == 0xE3069283.
// Any length, any alignment; `data` may be null only when `length` is 0. Thread-safe.
uint32_t Crc32c(const void* data, size_t length);

// Continues a CRC over more bytes: Crc32cExtend(Crc32c(a), b) == Crc32c(a followed by b), so a
// chunk's CRC can be computed piece by piece as it is copied. Crc32cExtend(0, x) == Crc32c(x).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t length);

}  // namespace moesnap::erasure

#endif  // MOESNAP_ERASURE_CRC32C_H_
