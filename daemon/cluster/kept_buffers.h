// Host memory that fetched bytes are read into, kept between fetches up to a byte bound. A buffer
// of a few MiB fresh from the heap is a new mapping: its first touch costs a page fault and a
// zeroed page per 4 KiB, which measured more than receiving the bytes into it over loopback.
#ifndef MOESNAP_DAEMON_CLUSTER_KEPT_BUFFERS_H_
#define MOESNAP_DAEMON_CLUSTER_KEPT_BUFFERS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace moesnap::daemon::cluster {

// Thread-safe. Not pool memory: the node that fetches is live, and its captures need the pool's
// room.
class KeptBuffers {
 public:
  // Buffers are handed out in multiples of this, so that fetches of slightly different sizes
  // reuse one another's.
  static constexpr uint64_t kGranule = uint64_t{1} << 20;

  // Keeps at most `max_kept_bytes` of buffers not in use.
  explicit KeptBuffers(uint64_t max_kept_bytes) : max_kept_bytes_(max_kept_bytes) {}

  // A buffer of at least `bytes` bytes, not zeroed, until the lease ends; then it is kept for the
  // next Take if it fits the bound, else freed.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept;
    ~Lease() { Return(); }

    uint8_t* data() const { return data_.get(); }
    uint64_t capacity() const { return capacity_; }

   private:
    friend class KeptBuffers;
    void Return();

    KeptBuffers* owner_ = nullptr;
    std::unique_ptr<uint8_t[]> data_;
    uint64_t capacity_ = 0;
  };

  // The smallest kept buffer that holds `bytes`, else a new one.
  Lease Take(uint64_t bytes);

  // Bytes of the buffers kept and not in use.
  uint64_t kept_bytes() const;
  // Bytes of every buffer this hands out or keeps: leased now, or kept.
  uint64_t held_bytes() const;

 private:
  struct Kept {
    std::unique_ptr<uint8_t[]> data;
    uint64_t capacity = 0;
  };
  // Keeps a returned buffer, freeing smaller kept ones to make room; frees it when they cannot.
  void Keep(std::unique_ptr<uint8_t[]> data, uint64_t capacity);

  const uint64_t max_kept_bytes_;
  mutable absl::Mutex mutex_;
  std::vector<Kept> kept_ ABSL_GUARDED_BY(mutex_);  // by capacity, smallest first
  uint64_t kept_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
  uint64_t leased_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_KEPT_BUFFERS_H_
