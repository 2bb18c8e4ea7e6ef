// How the copy of many regions is cut into tasks for the capture threads, and where each region
// goes in one pool reservation: a step of thousands of small regions is a few tasks and one
// allocation, and a large region is still copied a chunk per task.
#ifndef MOESNAP_DAEMON_COPY_PLAN_H_
#define MOESNAP_DAEMON_COPY_PLAN_H_

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "daemon/pool.h"

namespace moesnap::daemon {

// Where the regions a step captures go in its pool reservation, and how their copy is cut into
// tasks of about one chunk each, so that a step of thousands of small regions is a few tasks.
struct CopyPlan {
  struct Part {
    uint32_t first = 0;  // into `order`: the positions order[first], ..., order[last - 1]
    uint32_t last = 0;
    // Regions of one chunk at most are copied whole, a run of them per part; a larger region is
    // copied one chunk per part.
    std::optional<uint32_t> chunk;
    // How many chunks the part copies.
    uint32_t chunks() const { return chunk ? 1 : last - first; }
  };
  // The positions (in the step's selection) in the order they are laid out in the reservation and
  // copied: the order of the trainer's memory, so that regions next to each other there are next
  // to each other in the pool, and a part reads and writes one stretch of each.
  std::vector<uint32_t> order;
  std::vector<uint64_t> offsets;  // in the reservation, per position
  std::vector<Part> parts;
  std::vector<uint32_t> large;    // positions of the regions of more than one chunk
  uint64_t bytes = 0;
  uint64_t space = 0;             // the reservation
};

inline uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max() : a + b;
}

// Positions 0 .. count - 1 ordered by rank_of(position) (each less than `ranks`), positions of
// equal rank in their order: a counting sort, linear in both.
template <typename RankOf>
std::vector<uint32_t> OrderByRank(size_t count, RankOf rank_of, size_t ranks) {
  std::vector<uint32_t> starts(ranks + 1, 0);
  for (uint32_t position = 0; position < count; ++position) ++starts[rank_of(position) + 1];
  for (size_t rank = 0; rank < ranks; ++rank) starts[rank + 1] += starts[rank];
  std::vector<uint32_t> order(count);
  for (uint32_t position = 0; position < count; ++position) {
    order[starts[rank_of(position)]++] = position;
  }
  return order;
}

// The plan of `count` regions laid out in `order` (a permutation of the positions; empty: 0, 1,
// ...): size_of(position) bytes each, copied and checksummed in chunks of chunk_of(position) bytes;
// runs of small regions make parts of up to `part_bytes`. Regions past `space_limit` (the pool's
// size) get no parts: such a plan can never be reserved, and its parts, as many as its chunks,
// would be bounded by nothing but what a trainer declares.
template <typename SizeOf, typename ChunkOf>
CopyPlan PlanCopy(size_t count, SizeOf size_of, ChunkOf chunk_of, uint64_t part_bytes,
                  uint64_t space_limit = std::numeric_limits<uint64_t>::max(),
                  std::vector<uint32_t> order = {}) {
  CopyPlan plan;
  if (order.empty()) {
    order.resize(count);
    for (uint32_t position = 0; position < count; ++position) order[position] = position;
  }
  assert(order.size() == count);  // a permutation of the positions, from the caller
  plan.order = std::move(order);
  plan.offsets.resize(count);
  uint64_t run_bytes = 0;
  for (uint32_t at = 0; at < count; ++at) {
    const uint32_t position = plan.order[at];
    const uint64_t bytes = size_of(position);
    const uint64_t chunk_bytes = chunk_of(position);
    plan.offsets[position] = plan.space;
    // Sizes come from trainers: sums saturate, and a plan of more than the address space is
    // refused by the pool like any other that does not fit.
    plan.bytes = SaturatingAdd(plan.bytes, bytes);
    plan.space = SaturatingAdd(plan.space, PoolReservation::SpaceFor(bytes));
    if (plan.space > space_limit || plan.space == std::numeric_limits<uint64_t>::max()) {
      continue;  // never copied: no parts
    }
    if (bytes > chunk_bytes) {
      plan.large.push_back(position);
      for (uint32_t chunk = 0; uint64_t{chunk} * chunk_bytes < bytes; ++chunk) {
        plan.parts.push_back({at, at + 1, chunk});
      }
      continue;
    }
    if (plan.parts.empty() || plan.parts.back().chunk || run_bytes + bytes > part_bytes) {
      plan.parts.push_back({at, at, std::nullopt});
      run_bytes = 0;
    }
    plan.parts.back().last = at + 1;
    run_bytes += bytes;
  }
  return plan;
}

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_COPY_PLAN_H_
