// The drain's write rate limit: after each piece written, sleeps until the bytes written so far
// are back within bytes_per_second of the time since Start. Not thread-safe: one drain uses it.
#ifndef MOESNAP_DAEMON_DURABLE_PACER_H_
#define MOESNAP_DAEMON_DURABLE_PACER_H_

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"
#include "daemon/durable/clock.h"

namespace moesnap::daemon::durable {

class Pacer {
 public:
  // `bytes_per_second` 0: no limit. `clock` must outlive the pacer.
  Pacer(uint64_t bytes_per_second, Clock* clock) : rate_(bytes_per_second), clock_(clock) {}

  void Start();
  // `bytes` more were written; returns early (without the full wait) once `stop` is set.
  void Account(uint64_t bytes, const std::atomic<bool>& stop);

 private:
  const uint64_t rate_;
  Clock* const clock_;
  absl::Time start_;
  uint64_t bytes_ = 0;
};

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_PACER_H_
