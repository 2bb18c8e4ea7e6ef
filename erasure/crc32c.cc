// CRC-32C over ISA-L. crc32_iscsi neither pre- nor post-inverts and takes an int length, so this
// file adds the standard inversions and feeds lengths beyond INT_MAX in pieces.
#include "erasure/crc32c.h"
#include "erasure/crc32c_shift.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <array>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moesnap::erasure {
namespace {
constexpr size_t kMaxPieceBytes = size_t{1} << 30;

#if defined(__x86_64__)

// The register after `bits` zero bits (a multiplication by x^bits modulo the polynomial).
constexpr uint32_t ShiftOverZeroBits(uint32_t state, int bits) {
  for (int bit = 0; bit < bits; ++bit) {
    state = (state >> 1) ^ ((state & 1u) != 0 ? internal::kReflectedPolynomial : 0u);
  }
  return state;
}

// kMultipliers[k] = x^(8 * 2^k - 33) modulo the polynomial, for k >= 3: the carry-less product of
// a register and kMultipliers[k], read by the crc32 instruction (which multiplies by x^32, and the
// reflected product carries one x more), is the register after 2^k zero bytes.
constexpr std::array<uint32_t, 64> Multipliers() {
  constexpr uint32_t kOne = 0x80000000u;  // x^0, reflected
  std::array<uint32_t, 64> multipliers{};
  for (int power = 3; power < 64; ++power) {
    // 8 * 2^k - 33 = 8 * (2^k - 5) + 7.
    multipliers[power] =
        ShiftOverZeroBits(internal::ShiftOverZeros(kOne, (uint64_t{1} << power) - 5), 7);
  }
  return multipliers;
}
constexpr std::array<uint32_t, 64> kMultipliers = Multipliers();

// internal::ShiftOverZeros in a few instructions per bit set in `bytes`: the bytes below 8 through
// the crc32 instruction over zeros, each larger power of two a carry-less multiplication.
__attribute__((target("sse4.2,pclmul"))) uint32_t ShiftOverZerosCarryless(uint32_t state,
                                                                           uint64_t bytes) {
  if ((bytes & 1) != 0) state = _mm_crc32_u8(state, 0);
  if ((bytes & 2) != 0) state = _mm_crc32_u16(state, 0);
  if ((bytes & 4) != 0) state = _mm_crc32_u32(state, 0);
  for (bytes &= ~uint64_t{7}; bytes != 0; bytes &= bytes - 1) {
    const int power = __builtin_ctzll(bytes);
    const __m128i product =
        _mm_clmulepi64_si128(_mm_cvtsi32_si128(static_cast<int>(state)),
                             _mm_cvtsi32_si128(static_cast<int>(kMultipliers[power])), 0x00);
    const auto product_bits = static_cast<uint64_t>(_mm_cvtsi128_si64(product));
    state = static_cast<uint32_t>(_mm_crc32_u64(0, product_bits));
  }
  return state;
}

bool HasCarrylessShift() {
  static const bool has = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul");
  return has;
}

#endif

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
#if defined(__x86_64__)
  if (HasCarrylessShift()) return ShiftOverZerosCarryless(crc_a, length_b) ^ crc_b;
#endif
  return internal::ShiftOverZeros(crc_a, length_b) ^ crc_b;
}

}  // namespace moesnap::erasure
