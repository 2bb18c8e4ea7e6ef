// XorInto: 32-byte vectors (loaded and stored with memcpy, so any alignment), then the tail.
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

}  // namespace moesnap::erasure
