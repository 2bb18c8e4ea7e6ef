// Store: a rank's trainer sessions (started, ended, and the ranks forgotten once they hold
// nothing), the registration of its regions, and the table it makes (RegionTable): the regions'
// replica-group shards, the order of the trainer's memory they lie in, and the plan of a whole-rank
// step.
#include "daemon/store.h"
#include "daemon/store_types.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/copy_plan.h"
#include "daemon/shard_layout.h"
#include "proto/step_state_name.h"

namespace moesnap::daemon {
namespace {

// Every region of a replica group must name the same members: the layout cuts them together.
absl::Status CheckGroupsAgree(const std::vector<const v1::RegionSpec*>& specs) {
  std::map<std::string, const v1::RegionSpec*> first;  // per group, the first region naming it
  for (const v1::RegionSpec* spec : specs) {
    if (!spec->has_replica_group()) continue;
    const v1::ReplicaGroup& group = spec->replica_group();
    auto [it, added] = first.emplace(group.name(), spec);
    if (!added && !SameMembers(it->second->replica_group(), group)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "replica group '", group.name(), "' has ranks [", absl::StrJoin(group.ranks(), ", "),
          "] for region '", spec->name(), "' but [",
          absl::StrJoin(it->second->replica_group().ranks(), ", "), "] for region '",
          it->second->name(), "'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

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

// A binary search over the indices (std::ranges::partition_point over an iota view would do, but
// clang with libstdc++ 12, the sanitizer builds', rejects it).
std::optional<uint32_t> Store::RegionTable::Find(std::string_view wanted) const {
  uint32_t first = 0;  // the first index whose name is not before `wanted`, once `count` is 0
  auto count = static_cast<uint32_t>(regions.size());
  while (count > 0) {
    const uint32_t half = count / 2;
    if (name(first + half) < wanted) {
      first += half + 1;
      count -= half + 1;
    } else {
      count = half;
    }
  }
  if (first == regions.size() || name(first) != wanted) return std::nullopt;
  return first;
}

const std::shared_ptr<const Store::RegionTable>& Store::RegionTable::None() {
  static const auto* none =
      new std::shared_ptr<const RegionTable>(std::make_shared<const RegionTable>());
  return *none;
}

Store::RegionTable::RegionTable(std::map<std::string, Region> by_name, uint64_t chunk_bytes,
                                uint32_t rank, uint64_t pool_bytes) {
  regions.reserve(by_name.size());
  name_starts.reserve(by_name.size() + 1);
  type_of.reserve(by_name.size());
  std::map<std::string, std::vector<uint32_t>> group_members;  // group -> its regions' indices
  absl::flat_hash_map<std::pair<std::string, std::vector<int64_t>>, uint32_t> type_index;
  for (auto& [region_name, region] : by_name) {
    const auto index = static_cast<uint32_t>(regions.size());
    auto [entry, added] = type_index.try_emplace(
        {region.spec.dtype(), {region.spec.shape().begin(), region.spec.shape().end()}},
        static_cast<uint32_t>(types.size()));
    if (added) types.push_back({entry->first.first, entry->first.second});
    type_of.push_back(entry->second);
    pieces.push_back({0, region.spec.bytes()});
    if (region.spec.has_replica_group()) {
      groups.emplace(region.spec.replica_group().name(), region.spec.replica_group());
      group_members[region.spec.replica_group().name()].push_back(index);
    }
    names.append(region_name);
    name_starts.push_back(names.size());
    regions.push_back(std::move(region));
  }
  for (const auto& [group_name, indices] : group_members) {
    const v1::ReplicaGroup& group = groups.at(group_name);
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


absl::Status Store::StartSession(uint32_t rank, uint64_t session) {
  absl::MutexLock lock(&mutex_);
  if (!ranks_.contains(rank) && ranks_.size() >= kMaxRanksKnown) {
    ForgetRanksHoldingNothing();
    if (ranks_.size() >= kMaxRanksKnown) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "rank ", rank, " is new to this daemon, which knows ", ranks_.size(),
          " ranks (with a trainer connected, or state held); a daemon knows at most ",
          kMaxRanksKnown));
    }
  }
  activity_.Active(rank);
  RankState& rank_state = ranks_[rank];
  rank_state.session = session;
  rank_state.connected = true;
  rank_state.regions = RegionTable::None();  // copies in flight keep their own references to the old table
  rank_state.restarting = rank_state.latest_committed.has_value();
  rank_state.replay.reset();
  if (rank_state.latest_snapshot) {
    rank_state.replay = RankState::Replay{*rank_state.latest_snapshot, std::nullopt};
  }
  return absl::OkStatus();
}

bool Store::CopyingTrainerMemory(uint32_t rank) const {
  absl::MutexLock lock(&mutex_);
  auto it = ranks_.find(rank);
  return it != ranks_.end() && it->second.copies->load() > 0;
}

void Store::EndSession(uint32_t rank, uint64_t session) {
  absl::MutexLock lock(&mutex_);
  auto it = ranks_.find(rank);
  if (it == ranks_.end() || it->second.session != session) return;  // a newer process took over
  activity_.Gone(rank);
  // Copies in flight finish from their own references; cluster steps stop waiting for the rank.
  it->second.regions = RegionTable::None();
  it->second.restarting = false;
  it->second.connected = false;
  // A trainer calling Hello under rank after rank must not grow the store: what holds nothing goes
  // (this rank, or a group's member that nothing waits for any more).
  ForgetRanksHoldingNothing();
  step_changed_.SignalAll();
}

bool Store::HoldsNothing(const RankState& rank_state) {
  return !rank_state.connected && rank_state.regions->regions.empty() && !rank_state.restarting &&
         !rank_state.replay && rank_state.committed.empty() && rank_state.steps.empty() &&
         !rank_state.latest_committed && !rank_state.latest_snapshot &&
         rank_state.windows.empty() && rank_state.replica_groups.empty() &&
         !rank_state.last_capture && rank_state.copies->load() == 0;
}

void Store::ForgetRanksHoldingNothing() {
  std::vector<uint32_t> idle;
  for (const auto& [rank, rank_state] : ranks_) {
    if (HoldsNothing(rank_state)) idle.push_back(rank);
  }
  if (idle.empty()) return;
  std::set<uint32_t> members;
  std::set<const RegionTable*> seen;  // a rank's steps mostly share its table
  auto add_members = [&](const RegionTable* table) {
    if (table->groups.empty() || !seen.insert(table).second) return;
    for (const auto& [name, group] : table->groups) {
      members.insert(group.ranks().begin(), group.ranks().end());
    }
  };
  for (const auto& [rank, rank_state] : ranks_) {
    add_members(rank_state.regions.get());
    for (const auto& [step, record] : rank_state.steps) {
      if (!IsFinished(record.state)) add_members(record.table.get());
    }
  }
  for (uint32_t rank : idle) {
    if (!members.contains(rank)) ranks_.erase(rank);
  }
}

absl::Status Store::RegisterRegions(uint32_t rank, const std::vector<v1::RegionSpec>& regions) {
  // The regions are the memory of the rank's process now: should a newer process start before they
  // are in, they are not its (its memory may even be what this process left, handed on).
  uint64_t session = 0;
  // A registration of a process that has ended (a late call) is refused: its regions would hold
  // the node's steps for a trainer that never snapshots.
  auto not_connected = [rank] {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " has no trainer process connected (it ended): call Hello again"));
  };
  {
    absl::MutexLock lock(&mutex_);
    auto it = ranks_.find(rank);
    if (it == ranks_.end() || !it->second.connected) return not_connected();
    session = it->second.session;
  }
  // Open everything first, outside the lock: a bad region fails the call without changing anything.
  std::map<std::string, RegionTable::Region> opened;
  for (const v1::RegionSpec& spec : regions) {
    CopyBackend* backend = BackendFor(spec.device());
    if (backend == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "region '", spec.name(), "' is GPU memory but this daemon has no CUDA copy backend"));
    }
    absl::StatusOr<std::shared_ptr<RegionSource>> source = backend->Open(rank, spec);
    if (!source.ok()) return source.status();
    opened[spec.name()] = {spec, *std::move(source), backend};
  }
  activity_.Active(rank);
  // The rank's next table is made outside the lock too; a registration that raced with this one
  // (or a new session) makes it start again from the table that won.
  while (true) {
    std::shared_ptr<const RegionTable> current;
    {
      absl::MutexLock lock(&mutex_);
      auto it = ranks_.find(rank);
      if (it == ranks_.end() || !it->second.connected) return not_connected();
      current = it->second.regions;
    }
    std::map<std::string, RegionTable::Region> merged = opened;
    for (const RegionTable::Region& region : current->regions) {
      merged.emplace(region.spec.name(), region);
    }
    if (merged.size() > kMaxRegionsPerRank) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "rank ", rank, " would hold ", merged.size(), " regions; a rank holds at most ",
          kMaxRegionsPerRank));
    }
    std::vector<const v1::RegionSpec*> specs;
    for (const auto& [name, region] : merged) specs.push_back(&region.spec);
    if (absl::Status same = CheckGroupsAgree(specs); !same.ok()) return same;
    auto next = std::make_shared<const RegionTable>(std::move(merged), options_.chunk_bytes, rank,
                                                    pool_->capacity());
    absl::MutexLock lock(&mutex_);
    auto it = ranks_.find(rank);
    if (it == ranks_.end() || (it->second.session == session && !it->second.connected)) {
      return not_connected();
    }
    RankState& rank_state = it->second;
    if (rank_state.session != session) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a newer process of rank ", rank, " started while these regions were registered"));
    }
    if (rank_state.regions != current) continue;
    rank_state.regions = std::move(next);
    rank_state.restarting = false;
    return absl::OkStatus();
  }
}

}  // namespace moesnap::daemon
