// Seeded byte streams that are the same on every platform and compiler (splitmix64), for test data
// that must not change under a new standard library: reference vectors depend on it.
#ifndef MOESNAP_TESTS_TESTING_DETERMINISTIC_BYTES_H_
#define MOESNAP_TESTS_TESTING_DETERMINISTIC_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace moesnap::testing {

class DeterministicBytes {
 public:
  explicit DeterministicBytes(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  void Fill(uint8_t* out, size_t length) {
    while (length > 0) {
      const uint64_t word = Next();
      const size_t piece = length < sizeof(word) ? length : sizeof(word);
      std::memcpy(out, &word, piece);  // little-endian byte order on every supported host
      out += piece;
      length -= piece;
    }
  }

  std::vector<uint8_t> Bytes(size_t length) {
    std::vector<uint8_t> bytes(length);
    Fill(bytes.data(), length);
    return bytes;
  }

 private:
  uint64_t state_;
};

}  // namespace moesnap::testing

#endif  // MOESNAP_TESTS_TESTING_DETERMINISTIC_BYTES_H_
