// Which committed steps are drained. Due steps depend only on the sequence of committed steps and
// on the wall clock, never on this node's history of drains, so the nodes of a job, which commit
// the same steps within milliseconds of each other, pick the same steps: a step is durable on the
// job only when it is on every node.
#ifndef MOESNAP_DAEMON_DURABLE_DRAIN_SCHEDULE_H_
#define MOESNAP_DAEMON_DURABLE_DRAIN_SCHEDULE_H_

#include <cstdint>
#include <optional>

#include "absl/time/time.h"

namespace moesnap::daemon::durable {

class DrainSchedule {
 public:
  // 0 switches a rule off.
  DrainSchedule(uint32_t every_steps, uint32_t every_seconds)
      : every_steps_(every_steps), every_seconds_(every_seconds) {}

  // Whether `step`, committed at `now` after `previous` (committed at `previous_time`), is due:
  // the first committed step of a new run of every_steps steps (step / every_steps differs from
  // previous / every_steps), or the first committed after a multiple of every_seconds of Unix
  // time passed since `previous_time`.
  bool Due(std::optional<int64_t> previous, int64_t step, absl::Time previous_time,
           absl::Time now) const;

 private:
  const uint32_t every_steps_;
  const uint32_t every_seconds_;
};

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_DRAIN_SCHEDULE_H_
