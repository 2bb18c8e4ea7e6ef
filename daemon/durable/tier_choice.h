// The decision of which tier serves a rank's restore: memory while every node of the job still
// holds the committed state, the newest step durable on every node once one of them does not
// (more than m nodes of a group lost, a power loss, a new set of machines). A pure function of
// what the nodes report and what the cluster records, so every case is tested in-process.
#ifndef MOESNAP_DAEMON_DURABLE_TIER_CHOICE_H_
#define MOESNAP_DAEMON_DURABLE_TIER_CHOICE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "daemon/durable/job_view.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::durable {

struct TierInputs {
  // This node's memory holds the rank's committed state (and the node is not a replacement whose
  // rebuild failed); `memory_problem` says why not when it is false and there is a reason.
  bool memory_here = false;
  absl::Status memory_problem;
  std::vector<int64_t> durable_here;  // complete steps on this node's disk
  MemorySurvey peers;                 // the other nodes' memory; empty on a single node
};

struct TierChoice {
  v1::Tier tier = v1::TIER_UNSPECIFIED;  // UNSPECIFIED: nothing to restore from
  std::optional<int64_t> step;           // the durable step (memory: the store says which)
  std::string reason;
};

// `everywhere` reads the newest step durable on every node; it is called only when memory does not
// serve and this node has a durable step. UNAVAILABLE when it cannot be decided yet: a node still
// rebuilds, or the records of durable steps cannot be read. DATA_LOSS when the step recorded as
// durable on every node is not on this node's disk.
absl::StatusOr<TierChoice> ChooseTier(
    const TierInputs& inputs, absl::FunctionRef<absl::StatusOr<DurableEverywhere>()> everywhere);

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_TIER_CHOICE_H_
