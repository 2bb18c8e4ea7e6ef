// XorInto, XorOf: 32-byte vectors (loaded and stored with memcpy, so any alignment), then the tail.
#include "erasure/xor_bytes.h"

#include <cstring>

namespace moesnap::erasure {
namespace {

using Block = uint64_t __attribute__((vector_size(32)));

}  // namespace

void XorInto(uint8_t* out, const uint8_t* in, size_t length) {
  size_t i = 0;
  for (; i + sizeof(Block) <= length; i += sizeof(Block)) {
    Block a, b;
    std::memcpy(&a, out + i, sizeof(Block));
    std::memcpy(&b, in + i, sizeof(Block));
    a ^= b;
    std::memcpy(out + i, &a, sizeof(Block));
  }
  for (; i < length; ++i) out[i] ^= in[i];
}

void XorOf(uint8_t* out, const uint8_t* a, const uint8_t* b, size_t length) {
  size_t i = 0;
  for (; i + sizeof(Block) <= length; i += sizeof(Block)) {
    Block x, y;
    std::memcpy(&x, a + i, sizeof(Block));
    std::memcpy(&y, b + i, sizeof(Block));
    x ^= y;
    std::memcpy(out + i, &x, sizeof(Block));
  }
  for (; i < length; ++i) out[i] = a[i] ^ b[i];
}

}  // namespace moesnap::erasure
