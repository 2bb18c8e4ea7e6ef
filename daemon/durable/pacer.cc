// Pacer: the time the bytes so far may take at the limit, against the time they took.
#include "daemon/durable/pacer.h"

#include <algorithm>

namespace moesnap::daemon::durable {
namespace {

// Sleeps are sliced so that a stop (the daemon shutting down) is seen promptly.
constexpr absl::Duration kLongestSleep = absl::Milliseconds(100);

}  // namespace

void Pacer::Start() {
  start_ = clock_->Now();
  bytes_ = 0;
}

void Pacer::Account(uint64_t bytes, const std::atomic<bool>& stop) {
  bytes_ += bytes;
  if (rate_ == 0) return;
  const absl::Time due = start_ + absl::Seconds(static_cast<double>(bytes_) / static_cast<double>(rate_));
  for (absl::Time now = clock_->Now(); now < due && !stop.load(); now = clock_->Now()) {
    clock_->SleepFor(std::min(due - now, kLongestSleep));
  }
}

}  // namespace moesnap::daemon::durable
