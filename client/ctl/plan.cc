// `moesnapctl plan`: text and JSON renderings of a placement plan.
#include "client/ctl/plan.h"

#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/ctl/format.h"

namespace moesnap::ctl {

absl::StatusOr<std::vector<double>> ParseLoads(const std::string& text) {
  std::vector<double> loads;
  std::istringstream lines(text);
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    std::string word;
    while (words >> word) {
      size_t used = 0;
      double load = 0;
      try {
        load = std::stod(word, &used);
      } catch (...) {
        used = 0;
      }
      if (used != word.size()) {
        return absl::InvalidArgumentError(absl::StrCat("line ", number, ": '", word,
                                                       "' is not a number"));
      }
      loads.push_back(load);
    }
  }
  return loads;
}

absl::StatusOr<std::string> RunPlan(const PlanRequest& request, bool json) {
  absl::StatusOr<std::vector<int>> replicas = AllocateReplicas(request.loads, request.options);
  if (!replicas.ok()) return replicas.status();
  absl::StatusOr<Placement> overlap = PlaceMaximumOverlap(*replicas, request.options);
  if (!overlap.ok()) return overlap.status();
  absl::StatusOr<Placement> spread = PlaceSpread(*replicas, request.options);
  if (!spread.ok()) return spread.status();
  const int experts = static_cast<int>(request.loads.size());
  const std::vector<RecoveryProbability> with_overlap = RecoveryProbabilities(*overlap, experts);
  const std::vector<RecoveryProbability> with_spread = RecoveryProbabilities(*spread, experts);
  std::optional<Reconfiguration> reconfiguration;
  if (!request.failed.empty()) {
    absl::StatusOr<Reconfiguration> planned =
        Reconfigure(request.loads, request.options, *overlap, request.failed);
    if (!planned.ok()) return planned.status();
    reconfiguration = *std::move(planned);
  }
  auto placement_json = [](const Placement& placement) {
    std::vector<std::string> nodes;
    for (const std::vector<int>& node : placement) nodes.push_back(absl::StrCat("[", absl::StrJoin(node, ","), "]"));
    return absl::StrCat("[", absl::StrJoin(nodes, ","), "]");
  };
  if (json) {
    std::vector<std::string> rows;
    for (size_t f = 0; f < with_overlap.size(); ++f) {
      rows.push_back(absl::StrFormat(
          "{\"failed\":%d,\"overlap\":%.6f,\"overlap_low\":%.6f,\"overlap_high\":%.6f,"
          "\"spread\":%.6f,\"exact\":%s}",
          with_overlap[f].failed, with_overlap[f].probability, with_overlap[f].low,
          with_overlap[f].high, with_spread[f].probability, with_overlap[f].exact ? "true" : "false"));
    }
    std::string out = absl::StrCat("{\"replicas\":[", absl::StrJoin(*replicas, ","),
                                   "],\"placement\":", placement_json(*overlap),
                                   ",\"spread_placement\":", placement_json(*spread),
                                   ",\"recovery\":[", absl::StrJoin(rows, ","), "]");
    if (reconfiguration) {
      std::vector<std::string> transfers;
      for (const Transfer& transfer : reconfiguration->transfers) {
        transfers.push_back(absl::StrCat("{\"expert\":", transfer.expert, ",\"from\":",
                                         transfer.from ? absl::StrCat(*transfer.from) : "\"snapshot\"",
                                         ",\"to\":", transfer.to, "}"));
      }
      absl::StrAppend(&out, ",\"reconfiguration\":{\"survivors\":[",
                      absl::StrJoin(reconfiguration->survivors, ","), "],\"replicas\":[",
                      absl::StrJoin(reconfiguration->replicas, ","), "],\"placement\":",
                      placement_json(reconfiguration->placement), ",\"transfers\":[",
                      absl::StrJoin(transfers, ","), "]}");
    }
    return out + "}\n";
  }
  std::vector<std::vector<std::string>> allocation = {{"EXPERT", "LOAD", "REPLICAS"}};
  for (int e = 0; e < experts; ++e) {
    allocation.push_back({absl::StrCat(e), absl::StrCat(request.loads[e]), absl::StrCat((*replicas)[e])});
  }
  std::vector<std::vector<std::string>> nodes = {{"NODE", "EXPERTS (maximum rank overlap)", "EXPERTS (spread)"}};
  for (int node = 0; node < request.options.nodes; ++node) {
    nodes.push_back({absl::StrCat(node), absl::StrJoin((*overlap)[node], " "),
                     absl::StrJoin((*spread)[node], " ")});
  }
  std::vector<std::vector<std::string>> recovery = {{"FAILED", "P(all experts kept), overlap", "spread"}};
  for (size_t f = 0; f < with_overlap.size(); ++f) {
    const RecoveryProbability& row = with_overlap[f];
    recovery.push_back({absl::StrCat(row.failed),
                        row.exact ? absl::StrFormat("%.4f", row.probability)
                                  : absl::StrFormat("%.4f [%.4f, %.4f]", row.probability, row.low, row.high),
                        absl::StrFormat("%.4f", with_spread[f].probability)});
  }
  std::string out = absl::StrCat(Table(allocation), "\n", Table(nodes), "\n", Table(recovery));
  if (reconfiguration) {
    std::vector<std::vector<std::string>> transfers = {{"EXPERT", "FROM", "TO"}};
    for (const Transfer& transfer : reconfiguration->transfers) {
      transfers.push_back({absl::StrCat(transfer.expert),
                           transfer.from ? absl::StrCat("node ", *transfer.from) : "snapshot cluster",
                           absl::StrCat("node ", transfer.to)});
    }
    absl::StrAppend(&out, "\nafter losing nodes ", absl::StrJoin(request.failed, ", "), ": ",
                    reconfiguration->transfers.size(), " transfers\n", Table(transfers));
  }
  return out;
}

}  // namespace moesnap::ctl
