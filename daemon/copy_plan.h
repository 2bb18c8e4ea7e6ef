// How the copy of many regions is cut into tasks for the capture threads, and where each region
// goes in one pool reservation: a step of thousands of small regions is a few tasks and one
// allocation, and a large region is still copied a chunk per task.
#ifndef MOESNAP_DAEMON_COPY_PLAN_H_
#define MOESNAP_DAEMON_COPY_PLAN_H_

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
    uint32_t first = 0;  // positions in the step's selection: [first, last)
    uint32_t last = 0;
    // Regions of one chunk at most are copied whole, a run of them per part; a larger region is
    // copied one chunk per part.
    std::optional<uint32_t> chunk;
  };
  std::vector<uint64_t> offsets;  // in the reservation, per position
  std::vector<Part> parts;
  std::vector<uint32_t> large;    // positions of the regions of more than one chunk
  uint64_t bytes = 0;
  uint64_t space = 0;             // the reservation
};

inline uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max() : a + b;
}

// The plan of `count` regions, in order: size_of(position) bytes each, copied and checksummed in
// chunks of chunk_of(position) bytes; runs of small regions make parts of up to `part_bytes`.
// Regions past `space_limit` (the pool's size) get no parts: such a plan can never be reserved,
// and its parts, as many as its chunks, would be bounded by nothing but what a trainer declares.
template <typename SizeOf, typename ChunkOf>
CopyPlan PlanCopy(size_t count, SizeOf size_of, ChunkOf chunk_of, uint64_t part_bytes,
                  uint64_t space_limit = std::numeric_limits<uint64_t>::max()) {
  CopyPlan plan;
  plan.offsets.reserve(count);
  uint64_t run_bytes = 0;
  for (uint32_t position = 0; position < count; ++position) {
    const uint64_t bytes = size_of(position);
    const uint64_t chunk_bytes = chunk_of(position);
    plan.offsets.push_back(plan.space);
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
        plan.parts.push_back({position, position + 1, chunk});
      }
      continue;
    }
    if (plan.parts.empty() || plan.parts.back().chunk || run_bytes + bytes > part_bytes) {
      plan.parts.push_back({position, position, std::nullopt});
      run_bytes = 0;
    }
    plan.parts.back().last = position + 1;
    run_bytes += bytes;
  }
  return plan;
}

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_COPY_PLAN_H_
