// PlacementPlanner: allocation, maximum-rank-overlap and spread placements, recovery probabilities
// (exact over node subsets, or Monte Carlo), and reconfiguration after failures.
#include "moesnap/placement_planner.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"

namespace moesnap {
namespace {

absl::Status Check(const std::vector<double>& loads, const PlanOptions& options) {
  const int experts = static_cast<int>(loads.size());
  if (options.nodes < 1 || options.slots < 1 || options.min_replicas < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nodes, slots and min_replicas must be at least 1, got ", options.nodes, ", ",
        options.slots, ", ", options.min_replicas));
  }
  if (experts < 1) return absl::InvalidArgumentError("no expert loads given");
  for (int e = 0; e < experts; ++e) {
    if (!std::isfinite(loads[e]) || loads[e] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("load of expert ", e, " is ", loads[e],
                                                     "; loads must be finite and >= 0"));
    }
  }
  if (options.min_replicas > options.nodes) {
    return absl::InvalidArgumentError(absl::StrCat("min_replicas ", options.min_replicas,
                                                   " exceeds the ", options.nodes, " nodes"));
  }
  if (options.slots > experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.slots, " slots per node but only ", experts,
        " experts: a node never holds an expert twice, so slots must be at most the experts"));
  }
  if (int64_t{experts} * options.min_replicas > int64_t{options.nodes} * options.slots) {
    return absl::InvalidArgumentError(absl::StrCat(
        experts, " experts x ", options.min_replicas, " replicas do not fit ", options.nodes,
        " nodes x ", options.slots, " slots"));
  }
  return absl::OkStatus();
}

// Expert indices by ascending load, ties by index.
std::vector<int> ByLoad(const std::vector<double>& loads) {
  std::vector<int> order(loads.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return loads[a] < loads[b]; });
  return order;
}

absl::Status CheckReplicas(const std::vector<int>& replicas, const PlanOptions& options) {
  int64_t total = 0;
  for (size_t e = 0; e < replicas.size(); ++e) {
    if (replicas[e] < 1 || replicas[e] > options.nodes) {
      return absl::InvalidArgumentError(absl::StrCat("expert ", e, " has ", replicas[e],
                                                     " replicas; each needs 1 to ", options.nodes));
    }
    total += replicas[e];
  }
  if (total > int64_t{options.nodes} * options.slots) {
    return absl::InvalidArgumentError(absl::StrCat(total, " replicas do not fit ", options.nodes,
                                                   " nodes x ", options.slots, " slots"));
  }
  return absl::OkStatus();
}

// Whether experts with `counts` replicas (descending) fit nodes with `free` slots, one replica per
// node each: the Gale-Ryser condition for a 0-1 matrix with these row sums and column sums at most
// `free`.
bool Placeable(const std::vector<int>& counts, const std::vector<int>& free) {
  int64_t needed = 0;
  for (size_t k = 1; k <= counts.size(); ++k) {
    needed += counts[k - 1];
    int64_t room = 0;
    for (int slots : free) room += std::min<int64_t>(slots, k);
    if (needed > room) return false;
  }
  return true;
}

double Combinations(int n, int k) {
  double result = 1;
  for (int i = 1; i <= k; ++i) result = result * (n - k + i) / i;
  return result;
}

}  // namespace

absl::StatusOr<std::vector<int>> AllocateReplicas(const std::vector<double>& loads,
                                                  const PlanOptions& options) {
  if (absl::Status status = Check(loads, options); !status.ok()) return status;
  const int experts = static_cast<int>(loads.size());
  const std::vector<int> order = ByLoad(loads);
  int64_t remaining_slots = int64_t{options.nodes} * options.slots;
  double remaining_load = std::accumulate(loads.begin(), loads.end(), 0.0);
  std::vector<int> counts;  // in `order`
  for (int p = 0; p < experts; ++p) {
    const int expert = order[p];
    const int64_t after = experts - p - 1;
    int64_t share;
    if (after == 0) {
      share = remaining_slots;
    } else if (remaining_load > 0) {
      share = static_cast<int64_t>(std::floor(loads[expert] / remaining_load * remaining_slots));
    } else {
      share = remaining_slots / (after + 1);
    }
    int64_t count = std::max<int64_t>(options.min_replicas, share);
    count = std::min<int64_t>(count, remaining_slots - after * options.min_replicas);
    count = std::min<int64_t>(count, options.nodes);
    counts.push_back(static_cast<int>(count));
    remaining_slots -= count;
    remaining_load -= loads[expert];
  }
  // Slots left by the one-per-node cap go to the most loaded experts with room.
  for (int p = experts - 1; p >= 0 && remaining_slots > 0; --p) {
    const int64_t add = std::min<int64_t>(remaining_slots, options.nodes - counts[p]);
    counts[p] += static_cast<int>(add);
    remaining_slots -= add;
  }
  // Dealt back in load order: the same counts, non-decreasing in load.
  std::sort(counts.begin(), counts.end());
  std::vector<int> replicas(experts);
  for (int p = 0; p < experts; ++p) replicas[order[p]] = counts[p];
  return replicas;
}

namespace {

// Places experts in descending replica count, each on the `count` nodes with room that `prefer`
// ranks first (prefer(expert, node, free, previous) returns a sort key, smaller first) as long as
// the experts after it can still be placed (Gale-Ryser); otherwise on the nodes with the most free
// slots, which always leaves a placement possible.
template <typename Prefer>
absl::StatusOr<Placement> PlaceWith(const std::vector<int>& replicas, const PlanOptions& options,
                                    Prefer prefer) {
  if (absl::Status status = CheckReplicas(replicas, options); !status.ok()) return status;
  std::vector<int> order(replicas.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return replicas[a] > replicas[b]; });
  Placement placement(options.nodes);
  std::vector<int> free(options.nodes, options.slots);
  std::vector<bool> in_previous(options.nodes, false);  // nodes of the expert placed before
  for (size_t i = 0; i < order.size(); ++i) {
    const int expert = order[i];
    const int count = replicas[expert];
    std::vector<int> remaining;  // replica counts of the experts after this one, descending
    for (size_t j = i + 1; j < order.size(); ++j) remaining.push_back(replicas[order[j]]);
    auto choose = [&](bool preferred) {
      std::vector<int> nodes;
      for (int node = 0; node < options.nodes; ++node) {
        if (free[node] > 0) nodes.push_back(node);
      }
      std::stable_sort(nodes.begin(), nodes.end(), [&](int a, int b) {
        if (preferred) {
          const double ka = prefer(expert, a, free[a], in_previous[a]);
          const double kb = prefer(expert, b, free[b], in_previous[b]);
          if (ka != kb) return ka < kb;
        }
        if (free[a] != free[b]) return free[a] > free[b];
        return in_previous[a] && !in_previous[b];
      });
      nodes.resize(std::min<size_t>(nodes.size(), count));
      return nodes;
    };
    std::vector<int> chosen = choose(/*preferred=*/true);
    std::vector<int> after = free;
    for (int node : chosen) --after[node];
    if (static_cast<int>(chosen.size()) < count || !Placeable(remaining, after)) {
      chosen = choose(/*preferred=*/false);
    }
    if (static_cast<int>(chosen.size()) < count) {
      return absl::InternalError(absl::StrCat("no room left for expert ", expert, "'s replicas"));
    }
    std::fill(in_previous.begin(), in_previous.end(), false);
    for (int node : chosen) {
      placement[node].push_back(expert);
      --free[node];
      in_previous[node] = true;
    }
  }
  for (std::vector<int>& node : placement) std::sort(node.begin(), node.end());
  return placement;
}

}  // namespace

absl::StatusOr<Placement> PlaceMaximumOverlap(const std::vector<int>& replicas,
                                              const PlanOptions& options) {
  // Nested in the previous expert's nodes first.
  return PlaceWith(replicas, options, [](int, int, int, bool previous) { return previous ? 0.0 : 1.0; });
}

absl::StatusOr<Placement> PlaceSpread(const std::vector<int>& replicas, const PlanOptions& options) {
  // Nearest to the expert's evenly spaced ideal nodes (e + j N / r), away from the previous
  // expert's nodes.
  return PlaceWith(replicas, options, [&](int expert, int node, int, bool previous) {
    const int count = replicas[expert];
    double distance = options.nodes;
    for (int j = 0; j < count; ++j) {
      const int ideal = static_cast<int>((expert + int64_t{j} * options.nodes / count) % options.nodes);
      distance = std::min<double>(distance, (node - ideal + options.nodes) % options.nodes);
    }
    return distance + (previous ? 0.5 : 0.0);
  });
}

std::vector<RecoveryProbability> RecoveryProbabilities(const Placement& placement, int experts,
                                                       uint64_t exact_limit, uint64_t samples,
                                                       uint64_t seed) {
  const int nodes = static_cast<int>(placement.size());
  std::vector<std::vector<int>> holders(experts);
  for (int node = 0; node < nodes; ++node) {
    for (int expert : placement[node]) holders[expert].push_back(node);
  }
  auto survives = [&](const std::vector<bool>& failed) {
    for (const std::vector<int>& nodes_of : holders) {
      if (std::all_of(nodes_of.begin(), nodes_of.end(), [&](int node) { return failed[node]; })) {
        return false;
      }
    }
    return true;
  };
  std::vector<RecoveryProbability> result;
  std::mt19937_64 random(seed);
  for (int f = 0; f <= nodes; ++f) {
    RecoveryProbability row;
    row.failed = f;
    const double subsets = Combinations(nodes, f);
    if (subsets <= static_cast<double>(exact_limit)) {
      // Every subset of f failed nodes, as the combinations of a selection vector.
      std::vector<bool> failed(nodes, false);
      std::fill(failed.end() - f, failed.end(), true);
      uint64_t good = 0, total = 0;
      do {
        good += survives(failed);
        ++total;
      } while (std::next_permutation(failed.begin(), failed.end()));
      row.probability = row.low = row.high = static_cast<double>(good) / total;
    } else {
      std::vector<int> ids(nodes);
      std::iota(ids.begin(), ids.end(), 0);
      uint64_t good = 0;
      std::vector<bool> failed(nodes);
      for (uint64_t s = 0; s < samples; ++s) {
        std::fill(failed.begin(), failed.end(), false);
        for (int i = 0; i < f; ++i) {  // a partial Fisher-Yates shuffle picks f distinct nodes
          std::uniform_int_distribution<int> pick(i, nodes - 1);
          std::swap(ids[i], ids[pick(random)]);
          failed[ids[i]] = true;
        }
        good += survives(failed);
      }
      // Wilson score interval, 95%.
      const double n = static_cast<double>(samples), p = good / n, z = 1.96;
      const double center = (p + z * z / (2 * n)) / (1 + z * z / n);
      const double half = z * std::sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n);
      row.exact = false;
      row.probability = p;
      row.low = std::max(0.0, center - half);
      row.high = std::min(1.0, center + half);
    }
    result.push_back(row);
  }
  return result;
}

absl::StatusOr<Reconfiguration> Reconfigure(const std::vector<double>& loads,
                                            const PlanOptions& options, const Placement& current,
                                            const std::vector<int>& failed,
                                            const std::vector<uint64_t>& expert_bytes) {
  if (absl::Status status = Check(loads, options); !status.ok()) return status;
  const int experts = static_cast<int>(loads.size());
  if (static_cast<int>(current.size()) != options.nodes) {
    return absl::InvalidArgumentError(absl::StrCat("the current placement has ", current.size(),
                                                   " nodes, not ", options.nodes));
  }
  if (!expert_bytes.empty() && static_cast<int>(expert_bytes.size()) != experts) {
    return absl::InvalidArgumentError(absl::StrCat(expert_bytes.size(), " expert sizes for ",
                                                   experts, " experts"));
  }
  std::set<int> lost;
  for (int node : failed) {
    if (node < 0 || node >= options.nodes) {
      return absl::InvalidArgumentError(absl::StrCat("failed node ", node, " is not in [0, ",
                                                     options.nodes, ")"));
    }
    lost.insert(node);
  }
  Reconfiguration plan;
  for (int node = 0; node < options.nodes; ++node) {
    if (!lost.contains(node)) plan.survivors.push_back(node);
  }
  const int survivors = static_cast<int>(plan.survivors.size());
  if (int64_t{survivors} * options.slots < experts) {
    return absl::FailedPreconditionError(absl::StrCat(
        survivors, " surviving nodes x ", options.slots, " slots cannot hold the ", experts,
        " experts"));
  }
  PlanOptions reduced = options;
  reduced.nodes = survivors;
  reduced.min_replicas = std::min<int>(
      {options.min_replicas, survivors, static_cast<int>(int64_t{survivors} * options.slots / experts)});
  absl::StatusOr<std::vector<int>> replicas = AllocateReplicas(loads, reduced);
  if (!replicas.ok()) return replicas.status();
  plan.replicas = *replicas;

  // Keep every surviving replica the new counts still want, most replicated experts first.
  plan.placement.assign(options.nodes, {});
  std::vector<std::vector<int>> surviving_holders(experts);
  for (int node : plan.survivors) {
    for (int expert : current[node]) surviving_holders[expert].push_back(node);
  }
  std::vector<int> kept(experts, 0);
  for (int expert = 0; expert < experts; ++expert) {
    for (int node : surviving_holders[expert]) {
      if (kept[expert] >= plan.replicas[expert]) break;
      plan.placement[node].push_back(expert);
      ++kept[expert];
    }
  }
  // Place the rest on survivors with room, sourcing each from the surviving holder that has sent
  // the least so far, or from the snapshot cluster.
  std::vector<uint64_t> sent(options.nodes, 0);
  std::vector<int> order(experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return plan.replicas[a] > plan.replicas[b]; });
  for (int expert : order) {
    const uint64_t bytes = expert_bytes.empty() ? 1 : expert_bytes[expert];
    for (int missing = plan.replicas[expert] - kept[expert]; missing > 0; --missing) {
      auto held_before = [&](int node, int which) {
        return std::find(current[node].begin(), current[node].end(), which) != current[node].end();
      };
      int target = -1;
      for (int pass = 0; pass < 2 && target < 0; ++pass) {  // former holders first: nothing to move
        for (int node : plan.survivors) {
          auto& slots = plan.placement[node];
          if (static_cast<int>(slots.size()) < options.slots &&
              std::find(slots.begin(), slots.end(), expert) == slots.end() &&
              (pass == 1 || held_before(node, expert))) {
            target = node;
            break;
          }
        }
      }
      if (target < 0) {
        // The only free slots are on nodes that hold the expert already: move another expert g
        // from a full node Y to such a node X (one more transfer), and place this one on Y.
        for (int x : plan.survivors) {
          auto& at_x = plan.placement[x];
          if (static_cast<int>(at_x.size()) >= options.slots) continue;
          for (int y : plan.survivors) {
            auto& at_y = plan.placement[y];
            if (std::find(at_y.begin(), at_y.end(), expert) != at_y.end()) continue;
            for (int g : at_y) {
              if (std::find(at_x.begin(), at_x.end(), g) != at_x.end()) continue;
              if (!held_before(x, g)) {
                const uint64_t g_bytes = expert_bytes.empty() ? 1 : expert_bytes[g];
                plan.transfers.push_back({g, y, x, g_bytes});
                plan.bytes_moved += g_bytes;
                sent[y] += g_bytes;
              }
              at_x.push_back(g);
              at_y.erase(std::find(at_y.begin(), at_y.end(), g));
              target = y;
              break;
            }
            if (target >= 0) break;
          }
          if (target >= 0) break;
        }
      }
      if (target < 0) {
        return absl::InternalError(absl::StrCat("no surviving node has room for expert ", expert));
      }
      plan.placement[target].push_back(expert);
      if (held_before(target, expert)) continue;  // its bytes are still there
      Transfer transfer;
      transfer.expert = expert;
      transfer.to = target;
      transfer.bytes = bytes;
      const std::vector<int>& sources = surviving_holders[expert];
      if (!sources.empty()) {
        const int source = *std::min_element(sources.begin(), sources.end(),
                                             [&](int a, int b) { return sent[a] < sent[b]; });
        transfer.from = source;
        sent[source] += bytes;
      }
      plan.transfers.push_back(transfer);
      plan.bytes_moved += bytes;
    }
  }
  return plan;
}

}  // namespace moesnap
