// ChooseTier: memory unless a node lacks it; then the newest step durable on every node.
#include "daemon/durable/tier_choice.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moesnap::daemon::durable {

absl::StatusOr<TierChoice> ChooseTier(
    const TierInputs& inputs, absl::FunctionRef<absl::StatusOr<DurableEverywhere>()> everywhere) {
  for (const NodeMemory& node : inputs.peers.answered) {
    if (!node.settled) {
      return absl::UnavailableError(absl::StrCat(
          "node ", node.node_id, " is still rebuilding from its group; which tier serves the "
          "restore is known once it has finished"));
    }
  }
  std::vector<uint32_t> without_memory;
  for (const NodeMemory& node : inputs.peers.answered) {
    if (!node.memory_step) without_memory.push_back(node.node_id);
  }
  // A node that does not answer is taken to hold its memory: a node lost within the code's reach
  // is rebuilt, and one that is not says so once it answers.
  if (inputs.memory_here && without_memory.empty()) {
    return TierChoice{v1::TIER_MEMORY, std::nullopt,
                      inputs.peers.answered.empty() && inputs.peers.silent.empty()
                          ? "this node's memory holds the rank's committed state"
                          : "every node that answered holds the committed state in memory"};
  }
  const std::string lost =
      inputs.memory_here
          ? absl::StrCat("node", without_memory.size() > 1 ? "s " : " ",
                         absl::StrJoin(without_memory, ", "), " no longer hold",
                         without_memory.size() > 1 ? "" : "s", " the committed state in memory")
          : absl::StrCat("this node's memory holds no committed state of the rank",
                         inputs.memory_problem.ok()
                             ? ""
                             : absl::StrCat(" (", inputs.memory_problem.message(), ")"));
  if (inputs.durable_here.empty()) {
    if (inputs.memory_here) {
      return TierChoice{v1::TIER_MEMORY, std::nullopt,
                        absl::StrCat(lost, ", but this node has no durable step to fall back to")};
    }
    return TierChoice{v1::TIER_UNSPECIFIED, std::nullopt,
                      absl::StrCat(lost, " and this node has no durable step")};
  }
  absl::StatusOr<DurableEverywhere> newest = everywhere();
  if (!newest.ok()) {
    return absl::UnavailableError(absl::StrCat(
        lost, "; the newest step durable on every node is not known: ", newest.status().message()));
  }
  if (!newest->step) {
    return TierChoice{inputs.memory_here ? v1::TIER_MEMORY : v1::TIER_UNSPECIFIED, std::nullopt,
                      absl::StrCat(lost, ", and no step is durable on every node (", newest->reason,
                                   ")")};
  }
  if (std::find(inputs.durable_here.begin(), inputs.durable_here.end(), *newest->step) ==
      inputs.durable_here.end()) {
    return absl::DataLossError(absl::StrCat(
        lost, "; step ", *newest->step, " is recorded durable on every node (", newest->reason,
        "), but this node's disk holds only steps ", absl::StrJoin(inputs.durable_here, ", ")));
  }
  return TierChoice{v1::TIER_DURABLE, newest->step,
                    absl::StrCat(lost, "; step ", *newest->step, " is ", newest->reason)};
}

}  // namespace moesnap::daemon::durable
