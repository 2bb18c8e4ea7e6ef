// The job's control state as the units that decide use it: the log of step decisions, the nodes'
// records of their durable steps, and the coordinator's leadership. etcd holds them all
// (etcd_control.h); unit tests put fakes here.
#ifndef MOESNAP_DAEMON_CLUSTER_CONTROL_H_
#define MOESNAP_DAEMON_CLUSTER_CONTROL_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/durable/job_view.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

// Thread-safe.
class DecisionLog {
 public:
  virtual ~DecisionLog() = default;

  // Writes `decision` as the outcome of its step unless the step has one, and only while the
  // leadership of `decision.token()` holds. Returns what the log holds for the step now: this
  // decision or an earlier one. FAILED_PRECONDITION: that leadership is gone (a newer coordinator
  // leads). UNAVAILABLE: the log cannot be reached; try again.
  virtual absl::StatusOr<v1::StepDecision> Decide(const v1::StepDecision& decision) = 0;
  // The decisions of steps after `after` (every one when absent), in step order.
  virtual absl::StatusOr<std::vector<v1::StepDecision>> DecisionsAfter(
      std::optional<int64_t> after) = 0;
  // Drops the decisions of steps before `step` (no node needs them once every node applied a
  // later commit), while the leadership of `token` holds.
  virtual absl::Status ForgetBefore(int64_t step, int64_t token) = 0;
};

// Each node's record of the steps complete on its disk, kept where the decisions are, and the
// newest step durable on every node that the records and decisions give (durable_records.h).
// Thread-safe.
class DurableRecords {
 public:
  virtual ~DurableRecords() = default;

  // Records `steps` (oldest first) as this node's durable steps, replacing its earlier record,
  // only while this daemon is the node's registered member. FAILED_PRECONDITION: another daemon
  // holds the node now. UNAVAILABLE: not registered yet, or etcd cannot be reached.
  virtual absl::Status Record(const std::vector<int64_t>& steps) = 0;
  // UNAVAILABLE when the records cannot be read; FAILED_PRECONDITION when etcd holds more keys
  // under the records' prefix than a job's nodes write.
  virtual absl::StatusOr<durable::DurableEverywhere> NewestEverywhere() = 0;
  // The oldest step any node's valid record lists (none when no node records one): the decisions
  // from there on are what NewestEverywhere reads. Errors as NewestEverywhere's.
  virtual absl::StatusOr<std::optional<int64_t>> OldestRecorded() = 0;
};

// This node's candidacy for coordinator. Thread-safe.
class Leadership {
 public:
  virtual ~Leadership() = default;

  // Waits up to `timeout` until this node leads; then its fencing token. DEADLINE_EXCEEDED: another
  // node leads still; UNAVAILABLE or ABORTED: this node cannot campaign now (no lease).
  virtual absl::StatusOr<int64_t> Campaign(absl::Duration timeout) = 0;
  // False once the leadership of `token` is certainly gone (this node's lease was lost).
  virtual bool Holds(int64_t token) const = 0;
  // Steps down, so the next candidate leads without waiting for a lease to expire.
  virtual void Resign(int64_t token) = 0;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_CONTROL_H_
