// XOR of buffers: a data unit's delta (old XOR new) and the folding of parity deltas are this, over
// units of megabytes, so it runs a vector at a time instead of a byte.
#ifndef MOESNAP_ERASURE_XOR_BYTES_H_
#define MOESNAP_ERASURE_XOR_BYTES_H_

#include <cstddef>
#include <cstdint>

namespace moesnap::erasure {

// out[i] ^= in[i] for i < length. Any length, any alignment; the two must not overlap.
// Thread-safe.
void XorInto(uint8_t* out, const uint8_t* in, size_t length);
// out[i] = a[i] ^ b[i] for i < length, in one pass. Any length, any alignment; `out` must not
// overlap either input. Thread-safe.
void XorOf(uint8_t* out, const uint8_t* a, const uint8_t* b, size_t length);

}  // namespace moesnap::erasure

#endif  // MOESNAP_ERASURE_XOR_BYTES_H_
