// Store: restores of a rank's committed step into its registered regions, a replica group's
// regions assembled from every member's piece.
#include "daemon/store.h"
#include "daemon/store_types.h"

#include <algorithm>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/copy_plan.h"
#include "daemon/task_transfers.h"
#include "proto/restored_regions.h"
#include "proto/step_state_name.h"

namespace moesnap::daemon {

absl::StatusOr<v1::RestoreResponse> Store::Restore(uint32_t rank, std::optional<int64_t> step,
                                                   const std::vector<std::string>& regions,
                                                   absl::Time deadline,
                                                   std::vector<GroupRegion>* remote) {
  struct Work {
    std::shared_ptr<Version> version;
    const RegionTable::Region* region;  // in `table`
    // The version's, read while it is in cache: the plan reads them for every item.
    uint64_t bytes = 0;
    uint64_t chunk_bytes = 0;
  };
  std::shared_ptr<const RegionTable> table;
  std::optional<CopyInFlight> in_flight;  // until every part has copied (the wait below)
  auto work = std::make_shared<std::vector<Work>>();
  v1::RestoreResponse response;
  v1::RestoredRegions& restored = *response.mutable_restored();
  {
    absl::MutexLock lock(&mutex_);
    auto rank_it = ranks_.find(rank);
    if (rank_it == ranks_.end()) {
      return absl::NotFoundError(absl::StrCat("rank ", rank, " has no committed step to restore"));
    }
    RankState& rank_state = rank_it->second;
    if (absl::Status settled = AwaitSettled(rank, rank_state, deadline); !settled.ok()) {
      return settled;
    }
    if (!rank_state.latest_committed) {
      return absl::NotFoundError(absl::StrCat("rank ", rank, " has no committed step to restore"));
    }
    const int64_t latest = *rank_state.latest_committed;
    if (step && *step > latest) {
      return absl::NotFoundError(absl::StrCat("step ", *step, " of rank ", rank,
                                              " is not committed; the latest committed is ", latest));
    }
    if (step && *step < latest) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", *step, " of rank ", rank, " was superseded: only the latest committed step, ",
          latest, ", is kept"));
    }
    table = rank_state.regions;
    if (table->regions.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank, " has no registered regions to restore into: register them first"));
    }
    in_flight.emplace(rank_state.copies);
    // What the trainer registered at `index` against what `version` stored.
    auto check = [&](uint32_t index, const Version& version) -> absl::Status {
      const v1::RegionSpec& spec = table->regions[index].spec;
      const RegionTable::TensorType& type = table->type(index);
      if (spec.bytes() != version.RegionBytes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "region '", spec.name(), "' is ", spec.bytes(), " bytes in this trainer, but step ",
            version.step, " stored ", version.RegionBytes()));
      }
      if (!type.dtype.empty() && !version.dtype.empty() && type.dtype != version.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            "region '", spec.name(), "' is ", type.dtype, " in this trainer, but step ",
            version.step, " stored ", version.dtype));
      }
      if (!type.shape.empty() && !version.shape.empty() &&
          !std::equal(type.shape.begin(), type.shape.end(), version.shape.begin(),
                      version.shape.end())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "region '", spec.name(), "' has shape [", absl::StrJoin(type.shape, ", "),
            "] in this trainer, but step ", version.step, " stored [",
            absl::StrJoin(version.shape, ", "), "]"));
      }
      return absl::OkStatus();
    };
    auto not_committed = [rank](const std::string& name) {
      return absl::NotFoundError(absl::StrCat("region '", name, "' of rank ", rank,
                                              " has no committed version to restore"));
    };
    // The region's committed version (null when the rank has none): the whole region, or the
    // rank's piece of a replica group, which is then assembled from every member's piece.
    auto add = [&](uint32_t index, const std::shared_ptr<Version>* stored)
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) -> absl::Status {
      const RegionTable::Region& registered = table->regions[index];
      const v1::RegionSpec& spec = registered.spec;
      if (stored != nullptr && !(*stored)->is_piece()) {
        if (absl::Status status = check(index, **stored); !status.ok()) return status;
        work->push_back({*stored, &registered, (*stored)->bytes, (*stored)->chunk_bytes});
        AddRestored(restored, table->name(index), (*stored)->step, spec.bytes());
        return absl::OkStatus();
      }
      const v1::ReplicaGroupStep* layout =
          LayoutOf(rank_state, spec, stored != nullptr ? stored->get() : nullptr);
      if (layout == nullptr) return not_committed(spec.name());
      absl::StatusOr<HeldPieces> held = GroupPieces(*layout, spec.name(), remote != nullptr);
      if (!held.ok()) return held.status();
      for (const std::shared_ptr<Version>& piece : held->versions) {
        if (absl::Status status = check(index, *piece); !status.ok()) return status;
        work->push_back({piece, &registered, piece->bytes, piece->chunk_bytes});
      }
      AddRestored(restored, table->name(index),
                  held->versions.empty() ? 0 : held->versions.front()->step, spec.bytes());
      if (!held->remote_members.empty()) {
        remote->push_back({spec.name(), *layout, std::move(held->pieces),
                           std::move(held->remote_members)});
      }
      return absl::OkStatus();
    };
    const size_t count = regions.empty() ? table->regions.size() : regions.size();
    work->reserve(count);
    ReserveRestored(restored, static_cast<int>(count));
    if (regions.empty()) {
      // Both are in name order: one pass over each.
      auto stored = rank_state.committed.begin();
      for (uint32_t index = 0; index < table->regions.size(); ++index) {
        const std::string_view name = table->name(index);
        while (stored != rank_state.committed.end() && stored->first < name) ++stored;
        const bool found = stored != rank_state.committed.end() && stored->first == name;
        if (absl::Status status = add(index, found ? &stored->second : nullptr); !status.ok()) {
          return status;
        }
      }
    } else {
      for (const std::string& name : regions) {
        const std::optional<uint32_t> index = table->Find(name);
        if (!index) {
          return absl::NotFoundError(
              absl::StrCat("rank ", rank, " has not registered region '", name, "'"));
        }
        auto stored = rank_state.committed.find(name);
        const bool found = stored != rank_state.committed.end();
        if (absl::Status status = add(*index, found ? &stored->second : nullptr); !status.ok()) {
          return status;
        }
      }
    }
    response.set_step(latest);
    if (regions.empty()) {
      // The whole rank goes back to `latest`: steps after it are of a timeline that ended.
      for (auto& [later, record] : rank_state.steps) {
        if (later > latest && !IsFinished(record.state)) {
          AbortStep(rank_state, record, absl::AbortedError(absl::StrCat(
                                            "discarded: the rank restored step ", latest)));
          record.discarded = true;
        }
      }
      rank_state.latest_snapshot = latest;
      rank_state.replay.reset();
    }
  }

  // Copy outside the lock on the capture threads, a run of small regions or a chunk of a large one
  // per task; the versions held here cannot be freed by a concurrent commit. The first failure is
  // reported; the other parts still finish.
  const auto plan = std::make_shared<const CopyPlan>(PlanCopy(
      work->size(), [&](uint32_t position) { return (*work)[position].bytes; },
      [&](uint32_t position) { return (*work)[position].chunk_bytes; },
      options_.chunk_bytes, std::numeric_limits<uint64_t>::max(),
      table->InMemoryOrder(work->size(), [&](uint32_t position) {
        return static_cast<uint32_t>((*work)[position].region - table->regions.data());
      })));
  struct Progress {
    absl::Mutex mutex;
    uint64_t pending ABSL_GUARDED_BY(mutex) = 0;
    absl::Status status ABSL_GUARDED_BY(mutex);
  };
  auto progress = std::make_shared<Progress>();
  {
    absl::MutexLock lock(&progress->mutex);
    progress->pending = plan->parts.size();
  }
  std::vector<std::function<void()>> parts;
  for (size_t part = 0; part < plan->parts.size(); ++part) {
    parts.push_back([work, plan, part, rank, progress, table] {
      // Copies a chunk of a large version, or a run of small versions whole, into the trainer's
      // memory and checks each chunk's CRC-32C.
      const CopyPlan::Part& range = plan->parts[part];
      std::vector<std::pair<const Version*, uint32_t>> chunks;
      chunks.reserve(range.chunks());
      TaskTransfers transfers;
      transfers.Reserve(range.chunks());
      auto add = [&](const Work& item, uint32_t chunk) {
        const Version& version = *item.version;
        const uint64_t offset = uint64_t{chunk} * version.chunk_bytes;
        transfers.AddChunk(item.region->backend, item.region->source.get(),
                           version.piece_offset + offset, *version.stored, offset,
                           version.ChunkLength(chunk), version.chunk_crcs[chunk]);
        chunks.emplace_back(&version, chunk);
      };
      if (range.chunk) {
        add((*work)[plan->order[range.first]], *range.chunk);
      } else {
        for (uint32_t at = range.first; at < range.last; ++at) add((*work)[plan->order[at]], 0);
      }
      absl::Status status;
      std::pair<size_t, size_t> failed;
      const absl::Status copied = transfers.Run(
          [](CopyBackend& backend, std::span<Transfer> batch) {
            return backend.CopyInBatch(batch);
          },
          [&](size_t index, uint32_t crc) {
            const auto [version, chunk] = chunks[index];
            if (crc != version->chunk_crcs[chunk]) {
              status.Update(absl::DataLossError(absl::StrFormat(
                  "region '%s' of rank %d, step %d, chunk %d: stored CRC-32C %08x but the pool "
                  "holds %08x; the snapshot is corrupt (moesnapctl verify lists every damaged "
                  "chunk)",
                  version->region, rank, version->step, chunk, version->chunk_crcs[chunk], crc)));
            }
          },
          failed);
      if (!copied.ok()) {
        status.Update(NameFailedRun(
            copied, failed,
            [&](size_t index) {
              return std::pair<absl::string_view, uint32_t>(chunks[index].first->region,
                                                           chunks[index].second);
            },
            "restore"));
      }
      absl::MutexLock lock(&progress->mutex);
      progress->status.Update(status);
      --progress->pending;
    });
  }
  workers_.SubmitAll(std::move(parts));
  {
    absl::MutexLock lock(&progress->mutex);
    progress->mutex.Await(absl::Condition(
        +[](Progress* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mutex) { return p->pending == 0; },
        progress.get()));
    // A status of its own, not a second reference to the parts' one: a part's task may release
    // `progress` last, on its thread, after the caller has read the message.
    if (!progress->status.ok()) {
      return absl::Status(progress->status.code(), progress->status.message());
    }
  }
  return response;
}

const v1::ReplicaGroupStep* Store::LayoutOf(const RankState& rank_state,
                                            const v1::RegionSpec& spec,
                                            const Version* stored) const {
  const auto& layouts = rank_state.replica_groups;
  auto named = [&](const std::string& group) -> const v1::ReplicaGroupStep* {
    auto it = layouts.find(group);
    return it == layouts.end() ? nullptr : &it->second;
  };
  if (stored != nullptr) return named(stored->replica_group);
  // The rank's own shard holds nothing of the region: the group of the members' pieces here.
  for (const auto& [group, layout] : layouts) {
    for (uint32_t member : layout.group().ranks()) {
      auto it = ranks_.find(member);
      if (it == ranks_.end()) continue;
      auto version = it->second.committed.find(spec.name());
      if (version != it->second.committed.end() && version->second->replica_group == group) {
        return &layout;
      }
    }
  }
  if (spec.has_replica_group()) {
    if (const v1::ReplicaGroupStep* layout = named(spec.replica_group().name())) return layout;
  }
  return layouts.size() == 1 ? &layouts.begin()->second : nullptr;
}

absl::StatusOr<Store::HeldPieces> Store::GroupPieces(const v1::ReplicaGroupStep& layout,
                                                    const std::string& region,
                                                    bool allow_remote) const {
  HeldPieces held;
  for (uint32_t member : layout.group().ranks()) {
    auto it = ranks_.find(member);
    if (it == ranks_.end() || !it->second.latest_committed) {
      if (!allow_remote) {
        return absl::UnavailableError(absl::StrCat(
            "region '", region, "' of replica group '", layout.group().name(), "' (ranks [",
            absl::StrJoin(layout.group().ranks(), ", "), "] at step ", layout.step(),
            "): the shard of rank ", member, " is not held by this node"));
      }
      held.remote_members.push_back(member);
      continue;
    }
    auto version = it->second.committed.find(region);
    if (version != it->second.committed.end() &&
        version->second->replica_group == layout.group().name()) {
      held.versions.push_back(version->second);
      held.pieces.push_back({member, version->second->step, version->second->piece_offset,
                             version->second->bytes, version->second->region_bytes});
    }
  }
  if (held.remote_members.empty()) {
    if (absl::StatusOr<int64_t> step = CheckGroupCover(region, layout, held.pieces); !step.ok()) {
      return step.status();
    }
  }
  return held;
}

}  // namespace moesnap::daemon
