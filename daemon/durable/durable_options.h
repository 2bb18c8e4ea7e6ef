// [durable] of moesnapd.toml: where and how often the daemon drains committed steps to disk.
#ifndef MOESNAP_DAEMON_DURABLE_DURABLE_OPTIONS_H_
#define MOESNAP_DAEMON_DURABLE_DURABLE_OPTIONS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace moesnap::daemon::durable {

struct DurableOptions {
  // Where steps go (this node's in <directory>/node-<id>); empty: no durable tier.
  std::string directory;
  // Drain the first committed step of every run of `every_steps` steps (steps S with a new
  // S / every_steps), and/or the first committed step of every `every_seconds` of wall-clock time
  // (aligned to multiples of it, so the nodes of a job pick the same step). 0: not by that rule.
  uint32_t every_steps = 0;
  uint32_t every_seconds = 0;
  // Complete steps kept on disk; older ones are deleted once a newer one is complete (the newest
  // step durable on every node of the job is kept too).
  uint32_t keep = 2;
  // Write rate limit in bytes per second (0: as fast as the disk takes them).
  uint64_t bytes_per_second = 0;

  bool enabled() const { return !directory.empty(); }
  // With a directory: an absolute path, at least one of every_steps / every_seconds, keep >= 1.
  absl::Status Validate() const;
};

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_DURABLE_OPTIONS_H_
