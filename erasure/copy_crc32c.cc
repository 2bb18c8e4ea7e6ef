// Copy and CRC-32C in one pass. Two passes (memcpy, then a CRC over the copy) move every byte
// through the core twice, and in cache-sized pieces they keep memcpy from writing around the
// cache. Large copies here load each 8 bytes once into a register that is stored (non-temporal)
// and fed to the crc32 instruction, in three lanes of 64 KiB at a time (the instruction's latency
// is three times its throughput); the lanes' CRCs are joined by shifting them over the lanes after
// them. Lanes are long because the hardware prefetchers follow long streams: measured here, lanes
// of 4 KiB copied at 0.6 of memcpy, lanes of 64 KiB at 1.0-1.2. Copies too small for one block of
// lanes run as memcpy of a cache-sized block followed by ISA-L's CRC over it while it is in cache.
// With AVX-512, the lanes go a cache line at a time: one 64-byte load and one whole-line store,
// the CRC fed from the register (CopyLanesWide).
#include <array>
#include <cstdint>
#include <cstring>

#include "erasure/crc32c.h"
#include "erasure/crc32c_shift.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moesnap::erasure {
namespace {

constexpr size_t kBlockedPieceBytes = 64 << 10;
// CopyWithCrc32c takes the one-pass kernel wherever one block of three lanes fits: measured here,
// copies of 192-512 KiB ran one-pass at 1.0-1.3 of memcpy, blocked at 0.86-0.94.
constexpr size_t kLane = 64 << 10;
constexpr size_t kOnePassBytes = 3 * kLane;

uint32_t CopyBlocked(void* destination, const void* source, size_t length, uint32_t crc) {
  auto* to = static_cast<uint8_t*>(destination);
  const auto* from = static_cast<const uint8_t*>(source);
  for (size_t done = 0; done < length; done += kBlockedPieceBytes) {
    const size_t piece = length - done < kBlockedPieceBytes ? length - done : kBlockedPieceBytes;
    std::memcpy(to + done, from + done, piece);
    crc = Crc32cExtend(crc, to + done, piece);  // the destination: the bytes as stored
  }
  return crc;
}

#if defined(__x86_64__)

constexpr size_t kCacheLineBytes = 64;

// The register after kLane zero bytes, as four table lookups: a lane's CRC joins the CRC of the
// bytes before it as crc(s, A B) = shift(crc(s, A)) xor crc(0, B).
class LaneShift {
 public:
  constexpr LaneShift() {
    static_assert((kLane & (kLane - 1)) == 0, "a lane is a power of two bytes");
    const internal::LinearMap& map = internal::kZeroBytes[__builtin_ctzll(kLane)];
    for (int byte = 0; byte < 4; ++byte) {
      for (uint32_t value = 0; value < 256; ++value) {
        table_[byte][value] = internal::Apply(map, value << (8 * byte));
      }
    }
  }

  constexpr uint32_t operator()(uint32_t state) const {
    return table_[0][state & 0xff] ^ table_[1][(state >> 8) & 0xff] ^
           table_[2][(state >> 16) & 0xff] ^ table_[3][state >> 24];
  }

 private:
  std::array<std::array<uint32_t, 256>, 4> table_{};
};

// Built by the compiler: nothing is initialized at run time, so a copy interrupted by SIGBUS
// (daemon/bus_error_guard.h) never leaves a half-built table behind.
constexpr LaneShift kLaneShift;

// Copies `blocks` blocks of three lanes; `state` is the raw register (the CRC before its final
// inversion), `to` is aligned to a cache line. Every word is loaded once: the value stored is the
// value checksummed, whatever the source does meanwhile (a trainer may be writing it). An empty
// asm statement that may change the loaded values holds each in its register, so the compiler
// cannot load it again for a later use: without it, clang 14 turns the 64-byte load of
// CopyLanesWide into one load for the store and four 16-byte loads for the CRC.
__attribute__((target("sse4.2"))) uint32_t CopyLanes(uint8_t* to, const uint8_t* from,
                                                     size_t blocks, uint32_t state) {
  for (; blocks > 0; --blocks, from += 3 * kLane, to += 3 * kLane) {
    uint64_t first = state, second = 0, third = 0;
    for (size_t at = 0; at < kLane; at += 8) {
      uint64_t a, b, c;
      std::memcpy(&a, from + at, sizeof(a));
      std::memcpy(&b, from + kLane + at, sizeof(b));
      std::memcpy(&c, from + 2 * kLane + at, sizeof(c));
      asm("" : "+r"(a), "+r"(b), "+r"(c));  // loaded once (above)
      first = _mm_crc32_u64(first, a);
      second = _mm_crc32_u64(second, b);
      third = _mm_crc32_u64(third, c);
      _mm_stream_si64(reinterpret_cast<long long*>(to + at), static_cast<long long>(a));
      _mm_stream_si64(reinterpret_cast<long long*>(to + kLane + at), static_cast<long long>(b));
      _mm_stream_si64(reinterpret_cast<long long*>(to + 2 * kLane + at),
                      static_cast<long long>(c));
    }
    state = kLaneShift(kLaneShift(static_cast<uint32_t>(first)) ^ static_cast<uint32_t>(second)) ^
            static_cast<uint32_t>(third);
  }
  _mm_sfence();  // the streamed bytes are ordered before whatever publishes the copy
  return state;
}

// Two 8-byte words of `quarter`, in order, into the crc32 instruction's `state`.
__attribute__((target("sse4.2"))) inline uint64_t Crc32cOfQuarter(uint64_t state,
                                                                  __m128i quarter) {
  state = _mm_crc32_u64(state, static_cast<uint64_t>(_mm_cvtsi128_si64(quarter)));
  return _mm_crc32_u64(state, static_cast<uint64_t>(_mm_extract_epi64(quarter, 1)));
}

// The eight 8-byte words of `line`, in order, into the crc32 instruction's `state`. The quarters
// are taken with zero-masked extracts: GCC 12's unmasked ones start from an undefined register and
// warn that it is uninitialized.
__attribute__((target("avx512f,avx512dq,sse4.2"))) inline uint64_t Crc32cOfLine(uint64_t state,
                                                                               __m512i line) {
  state = Crc32cOfQuarter(state, _mm512_maskz_extracti64x2_epi64(0x3, line, 0));
  state = Crc32cOfQuarter(state, _mm512_maskz_extracti64x2_epi64(0x3, line, 1));
  state = Crc32cOfQuarter(state, _mm512_maskz_extracti64x2_epi64(0x3, line, 2));
  return Crc32cOfQuarter(state, _mm512_maskz_extracti64x2_epi64(0x3, line, 3));
}

// CopyLanes a cache line at a time: each line is loaded once into a register that is stored
// whole (non-temporal) and checksummed from the register. One store a line instead of eight: on
// the Intel Xeon measured, about 1.08x CopyLanes' rate alone (1.0-1.16), and a capture's median
// 0.97 of memcpy against 0.87.
__attribute__((target("avx512f,avx512dq,sse4.2"))) uint32_t CopyLanesWide(uint8_t* to,
                                                                         const uint8_t* from,
                                                                         size_t blocks,
                                                                         uint32_t state) {
  for (; blocks > 0; --blocks, from += 3 * kLane, to += 3 * kLane) {
    uint64_t first = state, second = 0, third = 0;
    for (size_t at = 0; at < kLane; at += kCacheLineBytes) {
      __m512i a = _mm512_loadu_si512(from + at);
      __m512i b = _mm512_loadu_si512(from + kLane + at);
      __m512i c = _mm512_loadu_si512(from + 2 * kLane + at);
      asm("" : "+v"(a), "+v"(b), "+v"(c));  // loaded once (CopyLanes)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(to + at), a);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(to + kLane + at), b);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(to + 2 * kLane + at), c);
      first = Crc32cOfLine(first, a);
      second = Crc32cOfLine(second, b);
      third = Crc32cOfLine(third, c);
    }
    state = kLaneShift(kLaneShift(static_cast<uint32_t>(first)) ^ static_cast<uint32_t>(second)) ^
            static_cast<uint32_t>(third);
  }
  _mm_sfence();  // the streamed bytes are ordered before whatever publishes the copy
  return state;
}

using Lanes = uint32_t (*)(uint8_t* to, const uint8_t* from, size_t blocks, uint32_t state);

// A head up to the destination's next cache line and a tail of less than one block go blocked;
// streaming stores combine into whole lines, so the lanes start on a line boundary.
uint32_t CopyInterleaved(void* destination, const void* source, size_t length, uint32_t crc,
                         Lanes lanes) {
  auto* to = static_cast<uint8_t*>(destination);
  const auto* from = static_cast<const uint8_t*>(source);
  const size_t misalignment = reinterpret_cast<uintptr_t>(to) % kCacheLineBytes;
  const size_t head = misalignment == 0 || length < kCacheLineBytes - misalignment
                          ? 0
                          : kCacheLineBytes - misalignment;
  crc = CopyBlocked(to, from, head, crc);
  const size_t blocks = (length - head) / (3 * kLane);
  crc = ~lanes(to + head, from + head, blocks, ~crc);
  const size_t done = head + blocks * 3 * kLane;
  return CopyBlocked(to + done, from + done, length - done, crc);
}

#endif

}  // namespace

bool CopyCrcKernelAvailable(CopyCrcKernel kernel) {
#if defined(__x86_64__)
  if (kernel == CopyCrcKernel::kInterleaved) return __builtin_cpu_supports("sse4.2");
  if (kernel == CopyCrcKernel::kInterleavedWide) {
    return __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512dq");
  }
#endif
  return kernel == CopyCrcKernel::kBlocked;
}

uint32_t CopyWithCrc32cUsing(CopyCrcKernel kernel, void* destination, const void* source,
                             size_t length, uint32_t crc) {
#if defined(__x86_64__)
  if (kernel != CopyCrcKernel::kBlocked && CopyCrcKernelAvailable(kernel)) {
    return CopyInterleaved(destination, source, length, crc,
                           kernel == CopyCrcKernel::kInterleavedWide ? CopyLanesWide : CopyLanes);
  }
#endif
  return CopyBlocked(destination, source, length, crc);
}

CopyCrcKernel OnePassKernel() {
#if defined(__x86_64__)
  // Measured faster on an Intel Xeon only; AMD's Zen 4 runs 512-bit operations as two halves.
  if (CopyCrcKernelAvailable(CopyCrcKernel::kInterleavedWide) && __builtin_cpu_is("intel")) {
    return CopyCrcKernel::kInterleavedWide;
  }
#endif
  return CopyCrcKernel::kInterleaved;
}

uint32_t CopyWithCrc32c(void* destination, const void* source, size_t length, uint32_t crc) {
  return CopyWithCrc32cUsing(length >= kOnePassBytes ? OnePassKernel() : CopyCrcKernel::kBlocked,
                             destination, source, length, crc);
}

}  // namespace moesnap::erasure
