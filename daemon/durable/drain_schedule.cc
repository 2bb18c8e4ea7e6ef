// DrainSchedule::Due: floor division of steps and of Unix seconds.
#include "daemon/durable/drain_schedule.h"

namespace moesnap::daemon::durable {
namespace {

int64_t FloorDivide(int64_t value, int64_t divisor) {
  const int64_t quotient = value / divisor;
  return (value % divisor != 0 && value < 0) ? quotient - 1 : quotient;
}

}  // namespace

bool DrainSchedule::Due(std::optional<int64_t> previous, int64_t step, absl::Time previous_time,
                        absl::Time now) const {
  if (every_steps_ > 0 &&
      (!previous || FloorDivide(step, every_steps_) != FloorDivide(*previous, every_steps_))) {
    return true;
  }
  if (every_seconds_ > 0) {
    const int64_t before = FloorDivide(absl::ToUnixSeconds(previous_time), every_seconds_);
    const int64_t after = FloorDivide(absl::ToUnixSeconds(now), every_seconds_);
    if (after != before) return true;
  }
  return false;
}

}  // namespace moesnap::daemon::durable
