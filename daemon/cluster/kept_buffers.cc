#include "daemon/cluster/kept_buffers.h"

#include <algorithm>
#include <utility>

namespace moesnap::daemon::cluster {

KeptBuffers::Lease& KeptBuffers::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Return();
    owner_ = std::exchange(other.owner_, nullptr);
    data_ = std::move(other.data_);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void KeptBuffers::Lease::Return() {
  if (owner_ != nullptr && data_ != nullptr) owner_->Keep(std::move(data_), capacity_);
  owner_ = nullptr;
  data_.reset();
  capacity_ = 0;
}

KeptBuffers::Lease KeptBuffers::Take(uint64_t bytes) {
  Lease lease;
  lease.owner_ = this;
  {
    absl::MutexLock lock(&mutex_);
    auto fits = std::find_if(kept_.begin(), kept_.end(),
                             [bytes](const Kept& kept) { return kept.capacity >= bytes; });
    if (fits != kept_.end()) {
      lease.data_ = std::move(fits->data);
      lease.capacity_ = fits->capacity;
      kept_bytes_ -= fits->capacity;
      leased_bytes_ += fits->capacity;
      kept_.erase(fits);
      return lease;
    }
  }
  // Rounded up without overflow: a size near the top of uint64_t is not rounded (and cannot be
  // allocated anyway).
  const uint64_t rounded = bytes > UINT64_MAX - (kGranule - 1)
                               ? bytes
                               : (bytes + kGranule - 1) / kGranule * kGranule;
  lease.capacity_ = std::max<uint64_t>(rounded, 1);
  lease.data_ = std::make_unique_for_overwrite<uint8_t[]>(lease.capacity_);
  absl::MutexLock lock(&mutex_);
  leased_bytes_ += lease.capacity_;
  return lease;
}

uint64_t KeptBuffers::kept_bytes() const {
  absl::MutexLock lock(&mutex_);
  return kept_bytes_;
}

uint64_t KeptBuffers::held_bytes() const {
  absl::MutexLock lock(&mutex_);
  return kept_bytes_ + leased_bytes_;
}

void KeptBuffers::Keep(std::unique_ptr<uint8_t[]> data, uint64_t capacity) {
  std::vector<Kept> freed;  // freed outside the lock
  {
    absl::MutexLock lock(&mutex_);
    leased_bytes_ -= capacity;
    if (capacity > max_kept_bytes_) return;
    // Smaller buffers give way to a larger one: it serves every fetch they would.
    while (kept_bytes_ + capacity > max_kept_bytes_ && !kept_.empty() &&
           kept_.front().capacity < capacity) {
      kept_bytes_ -= kept_.front().capacity;
      freed.push_back(std::move(kept_.front()));
      kept_.erase(kept_.begin());
    }
    if (kept_bytes_ + capacity > max_kept_bytes_) return;
    auto at = std::find_if(kept_.begin(), kept_.end(),
                           [capacity](const Kept& kept) { return kept.capacity > capacity; });
    kept_.insert(at, {std::move(data), capacity});
    kept_bytes_ += capacity;
  }
}

}  // namespace moesnap::daemon::cluster
