// Page-aligned, pre-faulted host buffers for benchmarks, so that no figure includes first-touch
// page faults or misaligned SIMD tails.
#ifndef MOESNAP_BENCH_ALIGNED_BUFFER_H_
#define MOESNAP_BENCH_ALIGNED_BUFFER_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace moesnap::bench {

class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t bytes, uint8_t fill = 0)
      : bytes_(bytes), data_(static_cast<uint8_t*>(std::aligned_alloc(4096, RoundUp(bytes)))) {
    if (data_ == nullptr) std::abort();  // a benchmark without its buffers has nothing to measure
    std::memset(data_.get(), fill, bytes);
  }
  uint8_t* data() const { return data_.get(); }
  size_t size() const { return bytes_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  static size_t RoundUp(size_t bytes) { return (bytes + 4095) / 4096 * 4096; }
  size_t bytes_;
  std::unique_ptr<uint8_t, Free> data_;
};

}  // namespace moesnap::bench

#endif  // MOESNAP_BENCH_ALIGNED_BUFFER_H_
