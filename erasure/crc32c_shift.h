// Moving a CRC-32C register over zero bytes, for erasure/ alone: a map that is linear over GF(2),
// so it is kept as the images of the 32 unit vectors and computed by the compiler for every power
// of two bytes. Joining the CRCs of two runs of bytes needs it (Crc32cCombine, and the multipliers
// of its carry-less shift), and so do the lanes of a one-pass copy.
#ifndef MOESNAP_ERASURE_CRC32C_SHIFT_H_
#define MOESNAP_ERASURE_CRC32C_SHIFT_H_

#include <array>
#include <cstddef>
#include <cstdint>

namespace moesnap::erasure::internal {

constexpr uint32_t kReflectedPolynomial = 0x82F63B78u;

// A GF(2)-linear map of 32-bit CRC registers, as the images of the 32 unit vectors.
using LinearMap = std::array<uint32_t, 32>;

constexpr uint32_t Apply(const LinearMap& map, uint32_t value) {
  uint32_t image = 0;
  for (int bit = 0; bit < 32; ++bit) image ^= map[bit] & (0u - ((value >> bit) & 1u));
  return image;
}

constexpr LinearMap Square(const LinearMap& map) {
  LinearMap squared{};
  for (int bit = 0; bit < 32; ++bit) squared[bit] = Apply(map, map[bit]);
  return squared;
}

// kZeroBytes[k]: the register after 2^k zero bytes as a function of the register before them.
constexpr std::array<LinearMap, 64> ZeroBytesMaps() {
  LinearMap map{};  // one zero bit: the register shifts right; a 1 leaving it folds in P
  map[0] = kReflectedPolynomial;
  for (int bit = 1; bit < 32; ++bit) map[bit] = 1u << (bit - 1);
  for (int bits = 1; bits < 8; bits *= 2) map = Square(map);
  std::array<LinearMap, 64> maps{};
  for (int power = 0; power < 64; ++power) {
    maps[power] = map;
    map = Square(map);
  }
  return maps;
}
inline constexpr std::array<LinearMap, 64> kZeroBytes = ZeroBytesMaps();

// The register after `bytes` zero bytes: a map per bit set in `bytes` (the maps commute).
constexpr uint32_t ShiftOverZeros(uint32_t state, uint64_t bytes) {
  for (int power = 0; bytes != 0; ++power, bytes >>= 1) {
    if (bytes & 1) state = Apply(kZeroBytes[power], state);
  }
  return state;
}

}  // namespace moesnap::erasure::internal

#endif  // MOESNAP_ERASURE_CRC32C_SHIFT_H_
