// CRC-32C (Castagnoli, the iSCSI polynomial 0x1EDC6F41): over Intel ISA-L's crc32_iscsi for bytes
// in place, and fused with the copy for bytes that move (a capture, a restore), so that moving and
// checksumming them is one pass over memory instead of two.
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

// The CRC-32C of `a` followed by `b`, from the CRC-32C of each and the length of `b`:
// Crc32cCombine(Crc32c(a), Crc32c(b), |b|) == Crc32c(a followed by b), without reading a byte, so
// that bytes copied in one pass can be checked against the CRCs of the pieces they were stored as.
// A shift per bit set in `length_b` (one for a power of two): a carry-less multiplication where
// the CPU has one (x86-64 with SSE4.2 and PCLMULQDQ), else 32 masked XORs. Thread-safe.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

// Copies `length` bytes from `source` to `destination` and returns the CRC-32C of the bytes as
// written there, extended from `crc`: CopyWithCrc32c(d, s, n, crc) == Crc32cExtend(crc, d, n) once
// it returns. The source may change under the copy (a trainer writing its tensors): the CRC is
// always of the bytes stored, never of a newer or older source byte. `destination` must not change
// under the call, and the two must not overlap. Any length, any alignment. Copies of 192 KiB and
// more write around the cache (non-temporal stores), as memcpy does for large copies. Thread-safe.
uint32_t CopyWithCrc32c(void* destination, const void* source, size_t length, uint32_t crc);

// The ways CopyWithCrc32c runs, named so that tests and benchmarks can run each at any length.
// kInterleaved (x86-64 with SSE4.2; CopyWithCrc32c's choice from 192 KiB on): one pass, each 8
// bytes loaded once into a register that is both stored, around the cache, and fed to the crc32
// instruction, three streams of 64 KiB at a time, the bytes that do not fill one such block
// blocked. kInterleavedWide (x86-64 with AVX-512F and DQ; CopyWithCrc32c's choice from 192 KiB on
// on Intel CPUs that have it): the same a cache line at a time, each 64 bytes loaded once into a
// register stored whole and fed to the crc32 instruction from there. kBlocked (any CPU;
// CopyWithCrc32c's choice below 192 KiB): memcpy of 64 KiB blocks, each checksummed by ISA-L from
// the destination while it is in cache.
enum class CopyCrcKernel { kInterleaved, kInterleavedWide, kBlocked };
bool CopyCrcKernelAvailable(CopyCrcKernel kernel);
// The kernel CopyWithCrc32c takes from 192 KiB on, on this CPU.
CopyCrcKernel OnePassKernel();
// CopyWithCrc32c through `kernel`; an unavailable kernel falls back to kBlocked.
uint32_t CopyWithCrc32cUsing(CopyCrcKernel kernel, void* destination, const void* source,
                             size_t length, uint32_t crc);

}  // namespace moesnap::erasure

#endif  // MOESNAP_ERASURE_CRC32C_H_
