// Expert replica placement for Mixture-of-Experts training that must survive node failures (the
// Lazarus algorithms), and the reconfiguration after failures.
//
// Allocation: N nodes with c expert slots each hold N*c replicas. Experts sorted by token load
// (ascending, ties by index) each get max(f, floor(load / remaining load x remaining slots)), never
// more than N (one replica per node) and never so many that a later expert would get fewer than f;
// the counts are then dealt back in load order, so they are non-decreasing in load. Every expert has
// at least f replicas, so any f - 1 failed nodes leave every expert a replica.
//
// Placement by maximum rank overlap: the N * c slots form one sequence, slot p on node p mod N, and
// experts in descending replica count take consecutive runs of it. Every expert's replicas sit on an
// interval of consecutive nodes, intervals follow each other around the ring, so experts share
// failure combinations ("eggs in one basket"), which raises the probability that a random set of
// survivors still holds every expert.
//
// Recovery probability: for F failed nodes chosen uniformly, the probability that every expert keeps
// a replica. Exact (every subset) when C(N, F) is at most `exact_limit`, else Monte Carlo with a 95%
// interval.
//
// Pure, deterministic functions (Monte Carlo takes its seed as input); safe from any thread.
#ifndef MOESNAP_CLIENT_PLACEMENT_PLANNER_H_
#define MOESNAP_CLIENT_PLACEMENT_PLANNER_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"

namespace moesnap {

struct PlanOptions {
  int nodes = 0;         // N
  int slots = 0;         // c: expert replicas a node holds
  int min_replicas = 1;  // f
};

// placement[node] = the experts the node holds (each at most once), in slot order.
using Placement = std::vector<std::vector<int>>;

// INVALID_ARGUMENT unless N >= 1, c >= 1, f >= 1, loads non-negative and finite, E * f <= N * c,
// f <= N and c <= E (a node never holds an expert twice).
absl::StatusOr<std::vector<int>> AllocateReplicas(const std::vector<double>& loads,
                                                  const PlanOptions& options);
// Maximum-rank-overlap placement of `replicas` (from AllocateReplicas) on N nodes of c slots.
absl::StatusOr<Placement> PlaceMaximumOverlap(const std::vector<int>& replicas,
                                              const PlanOptions& options);
// The spread placement to compare with: expert e's replicas evenly around the ring from node e
// (N / r nodes apart), each on the next node with room when its ideal one is full.
absl::StatusOr<Placement> PlaceSpread(const std::vector<int>& replicas, const PlanOptions& options);

struct RecoveryProbability {
  int failed = 0;
  double probability = 0;
  bool exact = true;
  double low = 0;   // 95% interval (equal to probability when exact)
  double high = 0;
};

// For every number of failed nodes 0..N.
std::vector<RecoveryProbability> RecoveryProbabilities(const Placement& placement, int experts,
                                                       uint64_t exact_limit = 200000,
                                                       uint64_t samples = 200000,
                                                       uint64_t seed = 1);

struct Transfer {
  int expert = 0;
  std::optional<int> from;  // a surviving node holding a replica; nullopt: the snapshot cluster
  int to = 0;
  uint64_t bytes = 0;
};

struct Reconfiguration {
  std::vector<int> survivors;  // node ids, ascending
  std::vector<int> replicas;   // the new allocation
  Placement placement;         // indexed by node id; failed nodes hold nothing
  std::vector<Transfer> transfers;
  uint64_t bytes_moved = 0;
};

// After `failed` nodes: allocates over the survivors (f lowered to what they can hold, if need be),
// keeps every replica that can stay where it is, and places the rest on survivors with free slots,
// each sourced from a surviving replica (spreading the sends) or from the snapshot cluster when none
// survived. `expert_bytes` is the state of one replica (empty: 1 each).
absl::StatusOr<Reconfiguration> Reconfigure(const std::vector<double>& loads,
                                            const PlanOptions& options, const Placement& current,
                                            const std::vector<int>& failed,
                                            const std::vector<uint64_t>& expert_bytes = {});

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_PLACEMENT_PLANNER_H_
