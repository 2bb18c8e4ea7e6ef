// `moesnapctl plan`: the placement planner on the command line (no daemon involved).
#ifndef MOESNAP_CLIENT_CTL_PLAN_H_
#define MOESNAP_CLIENT_CTL_PLAN_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moesnap/placement_planner.h"

namespace moesnap::ctl {

struct PlanRequest {
  std::vector<double> loads;
  PlanOptions options;
  std::vector<int> failed;  // empty: no reconfiguration
};

// Expert loads from text: numbers separated by white space or new lines; '#' starts a comment.
absl::StatusOr<std::vector<double>> ParseLoads(const std::string& text);
// The allocation, the overlap placement, recovery probability per failure count (overlap beside
// spread) and, with failed nodes, the reconfiguration; as tables, or as one JSON object.
absl::StatusOr<std::string> RunPlan(const PlanRequest& request, bool json);

}  // namespace moesnap::ctl

#endif  // MOESNAP_CLIENT_CTL_PLAN_H_
