// The wall clock and sleeping, behind an interface so that the drain's schedule and its rate
// limit can be tested with a fake clock.
#ifndef MOESNAP_DAEMON_DURABLE_CLOCK_H_
#define MOESNAP_DAEMON_DURABLE_CLOCK_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moesnap::daemon::durable {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
  virtual void SleepFor(absl::Duration duration) = 0;
};

class SystemClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
  void SleepFor(absl::Duration duration) override { absl::SleepFor(duration); }
};

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_CLOCK_H_
