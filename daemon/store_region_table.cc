// Store: a rank's registered regions (RegionTable): their replica-group shards, the order of the
// trainer's memory they lie in, and the plan of a whole-rank step.
#include "daemon/store.h"
#include "daemon/store_types.h"

#include <algorithm>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "daemon/copy_plan.h"
#include "daemon/shard_layout.h"

namespace moesnap::daemon {

// Host regions by memory and offset, GPU regions by device, allocation and offset, a shard by where
// it starts; name order among equals.
std::vector<uint32_t> Store::RegionTable::PlacesInMemory(const std::vector<Region>& regions,
                                                         const std::vector<ShardPiece>& pieces) {
  auto where = [&](uint32_t index) {
    const v1::RegionSpec& spec = regions[index].spec;
    const v1::RegionHandle& handle = spec.handle();
    return std::make_tuple(spec.device(), handle.cuda_device(), handle.memory(),
                           std::string_view(handle.cuda_memory_handle()),
                           handle.shm_offset() + handle.cuda_offset() + pieces[index].offset);
  };
  std::vector<uint32_t> by_place(regions.size());
  for (uint32_t index = 0; index < regions.size(); ++index) by_place[index] = index;
  std::stable_sort(by_place.begin(), by_place.end(),
                   [&](uint32_t a, uint32_t b) { return where(a) < where(b); });
  std::vector<uint32_t> place(regions.size());
  for (uint32_t at = 0; at < by_place.size(); ++at) place[by_place[at]] = at;
  return place;
}

const std::shared_ptr<const Store::RegionTable>& Store::RegionTable::None() {
  static const auto* none =
      new std::shared_ptr<const RegionTable>(std::make_shared<const RegionTable>());
  return *none;
}

Store::RegionTable::RegionTable(std::map<std::string, Region> by_name, uint64_t chunk_bytes,
                                uint32_t rank, uint64_t pool_bytes) {
  regions.reserve(by_name.size());
  std::map<std::string, std::vector<uint32_t>> group_members;  // group -> its regions' indices
  for (auto& [name, region] : by_name) {
    const auto index = static_cast<uint32_t>(regions.size());
    pieces.push_back({0, region.spec.bytes()});
    if (region.spec.has_replica_group()) {
      groups.emplace(region.spec.replica_group().name(), region.spec.replica_group());
      group_members[region.spec.replica_group().name()].push_back(index);
    }
    regions.push_back(std::move(region));
  }
  for (const auto& [name, indices] : group_members) {
    const v1::ReplicaGroup& group = groups.at(name);
    std::vector<uint64_t> sizes;
    for (uint32_t index : indices) sizes.push_back(regions[index].spec.bytes());
    const std::vector<ShardPiece> shard = ShardPieces(
        sizes, static_cast<uint32_t>(group.ranks_size()), MemberIndex(rank, group));
    for (size_t i = 0; i < indices.size(); ++i) pieces[indices[i]] = shard[i];
  }
  for (uint32_t index = 0; index < regions.size(); ++index) {
    if (pieces[index].bytes > 0) all.push_back(index);
  }
  place = PlacesInMemory(regions, pieces);
  plan_of_all = std::make_shared<const CopyPlan>(PlanCopy(
      all.size(), [this](uint32_t position) { return pieces[all[position]].bytes; },
      [chunk_bytes](uint32_t) { return chunk_bytes; }, chunk_bytes, pool_bytes,
      InMemoryOrder(all.size(), [this](uint32_t position) { return all[position]; })));
}

}  // namespace moesnap::daemon
