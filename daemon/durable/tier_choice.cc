// ChooseTier: memory unless a node lacks it; then the newest step durable on every node.
#include "daemon/durable/tier_choice.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moesnap::daemon::durable {

std::optional<int64_t> NewestCommonStep(const std::vector<const std::vector<int64_t>*>& lists) {
  if (lists.empty()) return std::nullopt;
  std::set<int64_t> common(lists[0]->begin(), lists[0]->end());
  for (size_t i = 1; i < lists.size(); ++i) {
    std::set<int64_t> next;
    for (int64_t step : *lists[i]) {
      if (common.contains(step)) next.insert(step);
    }
    common = std::move(next);
  }
  if (common.empty()) return std::nullopt;
  return *common.rbegin();
}

absl::StatusOr<TierChoice> ChooseTier(const TierInputs& inputs) {
  for (const NodeDurability& node : inputs.peers.answered) {
    if (!node.settled) {
      return absl::UnavailableError(absl::StrCat(
          "node ", node.node_id, " is still rebuilding from its group; which tier serves the "
          "restore is known once it has finished"));
    }
  }
  std::vector<uint32_t> without_memory;
  for (const NodeDurability& node : inputs.peers.answered) {
    if (!node.memory_step) without_memory.push_back(node.node_id);
  }
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
  if (!inputs.peers.silent.empty()) {
    std::vector<std::string> silent;
    for (const auto& [id, why] : inputs.peers.silent) silent.push_back(absl::StrCat(id, " (", why, ")"));
    if (inputs.memory_here) {
      return TierChoice{v1::TIER_MEMORY, std::nullopt,
                        absl::StrCat(lost, "; nodes ", absl::StrJoin(silent, ", "),
                                     " do not answer, so no step is known durable on every node")};
    }
    return absl::UnavailableError(absl::StrCat(
        lost, "; nodes ", absl::StrJoin(silent, ", "),
        " do not answer, so the newest step durable on every node is not known yet"));
  }
  std::vector<const std::vector<int64_t>*> lists = {&inputs.durable_here};
  for (const NodeDurability& node : inputs.peers.answered) lists.push_back(&node.durable_steps);
  const std::optional<int64_t> common = NewestCommonStep(lists);
  if (!common) {
    return TierChoice{inputs.memory_here ? v1::TIER_MEMORY : v1::TIER_UNSPECIFIED, std::nullopt,
                      absl::StrCat(lost, ", and no step is durable on every node")};
  }
  return TierChoice{v1::TIER_DURABLE, common,
                    absl::StrCat(lost, "; step ", *common, " is the newest durable on ",
                                 inputs.peers.answered.empty() ? "this node" : "every node")};
}

}  // namespace moesnap::daemon::durable
