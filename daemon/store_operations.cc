// Store: what operators see and do (moesnapctl status, steps, inspect, verify, drop).
#include "daemon/store.h"
#include "daemon/store_types.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "daemon/progress.h"

namespace moesnap::daemon {

v1::StatusResponse Store::Status() const {
  v1::StatusResponse status;
  status.set_pool_bytes(pool_->capacity());
  status.set_pool_name(pool_->file_name());
  status.set_uptime_seconds(static_cast<uint64_t>(absl::ToInt64Seconds(absl::Now() - started_)));
  absl::MutexLock lock(&mutex_);
  status.set_pool_in_flight_bytes(in_flight_bytes_);
  status.set_pool_used_bytes(pool_->capacity() - pool_->free_bytes() - in_flight_bytes_);
  status.set_ranks(static_cast<uint32_t>(ranks_.size()));
  status.set_journal_sequence(journal_->sequence());
  status.set_steps_superseded(steps_superseded_);
  status.set_snapshots_skipped(snapshots_skipped_);
  status.set_last_skip(last_skip_);
  for (const auto& [rank, reason] : activity_.Dropped()) {
    v1::DroppedRank* dropped = status.add_dropped_ranks();
    dropped->set_rank(rank);
    dropped->set_reason(reason);
  }
  for (const auto& [rank, rank_state] : ranks_) {
    if (rank_state.last_capture) *status.add_rank_captures() = *rank_state.last_capture;
  }
  return status;
}

v1::ListStepsResponse Store::ListSteps() const {
  v1::ListStepsResponse response;
  absl::MutexLock lock(&mutex_);
  for (const auto& [rank, rank_state] : ranks_) {
    // Committed state: one row per step that still has versions (sparse steps leave several).
    std::map<int64_t, v1::StepInfo> by_step;
    for (const auto& [region, version] : rank_state.committed) {
      v1::StepInfo& info = by_step[version->step];
      info.set_rank(rank);
      info.set_step(version->step);
      info.set_state(v1::STEP_STATE_COMMITTED);
      info.set_regions(info.regions() + 1);
      info.set_bytes(info.bytes() + version->bytes);
    }
    for (const auto& [step, record] : rank_state.steps) {
      if (record.state == v1::STEP_STATE_COMMITTED) continue;
      v1::StepInfo& info = by_step[step];
      info.set_rank(rank);
      info.set_step(step);
      info.set_state(record.state);
      info.set_regions(record.regions);
      info.set_bytes(record.bytes);
    }
    for (auto& [step, info] : by_step) *response.add_steps() = std::move(info);
  }
  return response;
}

v1::InspectStepResponse Store::InspectStep(int64_t step, std::optional<uint32_t> rank) const {
  v1::InspectStepResponse response;
  const v1::ListStepsResponse steps = ListSteps();
  for (const v1::StepInfo& info : steps.steps()) {
    if (info.step() == step && (!rank || info.rank() == *rank)) *response.add_steps() = info;
  }
  absl::MutexLock lock(&mutex_);
  for (const auto& [rank_id, rank_state] : ranks_) {
    if (rank && rank_id != *rank) continue;
    for (const auto& [region, version] : rank_state.committed) {
      if (version->step != step) continue;
      v1::VersionInfo* info = response.add_versions();
      info->set_rank(rank_id);
      info->set_region(region);
      info->set_step(step);
      info->set_state(v1::STEP_STATE_COMMITTED);
      info->set_bytes(version->bytes);
      info->set_dtype(version->dtype);
      for (int64_t dimension : version->shape) info->add_shape(dimension);
      info->set_chunks(version->chunks());
      version->SavePiece(info);
    }
    for (const auto& [name, layout] : rank_state.replica_groups) {
      if (layout.step() != step) continue;
      v1::RankReplicaGroup* group = response.add_replica_groups();
      group->set_rank(rank_id);
      *group->mutable_layout() = layout;
    }
  }
  return response;
}

v1::VerifyResponse Store::Verify(std::optional<int64_t> step) const {
  std::vector<std::shared_ptr<Version>> versions;
  {
    absl::MutexLock lock(&mutex_);
    for (const auto& [rank, rank_state] : ranks_) {
      for (const auto& [region, version] : rank_state.committed) {
        if (!step || version->step == *step) versions.push_back(version);
      }
    }
  }
  v1::VerifyResponse response;
  uint64_t total_bytes = 0;
  for (const std::shared_ptr<Version>& version : versions) total_bytes += version->bytes;
  OperationProgress progress = ProgressBoard::Default().Begin("verify", total_bytes, "bytes");
  for (const std::shared_ptr<Version>& version : versions) {
    for (uint32_t chunk = 0; chunk < version->chunks(); ++chunk) {
      progress.Advance(version->ChunkLength(chunk));
      const uint64_t offset = uint64_t{chunk} * version->chunk_bytes;
      const uint32_t actual = version->stored->Crc32c(offset, version->ChunkLength(chunk));
      if (actual != version->chunk_crcs[chunk]) {
        v1::VerifyResponse::Corruption* corruption = response.add_corruptions();
        corruption->set_rank(version->rank);
        corruption->set_region(version->region);
        corruption->set_step(version->step);
        corruption->set_chunk(chunk);
        corruption->set_expected_crc(version->chunk_crcs[chunk]);
        corruption->set_actual_crc(actual);
      }
      response.set_chunks_checked(response.chunks_checked() + 1);
    }
    response.set_versions_checked(response.versions_checked() + 1);
    response.set_bytes_checked(response.bytes_checked() + version->bytes);
  }
  return response;
}

absl::StatusOr<v1::DropStepResponse> Store::DropStep(int64_t step, std::optional<uint32_t> rank) {
  if (mode_ == CommitMode::kCluster) {
    return absl::FailedPreconditionError(
        "drop is refused in a cluster: the group's parity covers this node's committed versions, "
        "and dropping one would make the other nodes unrecoverable");
  }
  absl::MutexLock lock(&mutex_);
  // Take the versions out, journal the reduced state, and put them back if that write fails: a failed
  // drop drops nothing.
  v1::DropStepResponse response;
  std::vector<std::pair<uint32_t, std::string>> dropped;
  for (const auto& [rank_id, rank_state] : ranks_) {
    if (rank && rank_id != *rank) continue;
    for (const auto& [region, version] : rank_state.committed) {
      if (version->step != step) continue;
      dropped.emplace_back(rank_id, region);
      response.set_versions_dropped(response.versions_dropped() + 1);
      for (const std::shared_ptr<PoolExtent>& extent : version->stored->extents()) {
        response.set_bytes_freed(response.bytes_freed() + extent->bytes());
      }
    }
  }
  if (dropped.empty()) {
    return absl::NotFoundError(absl::StrCat("no committed version of step ", step,
                                            rank ? absl::StrCat(" for rank ", *rank) : "",
                                            " is stored"));
  }
  std::map<uint32_t, CommittedVersions> removed;
  for (const auto& [rank_id, region] : dropped) {
    RankState& rank_state = ranks_[rank_id];
    removed[rank_id][region] = std::move(rank_state.committed[region]);
    rank_state.committed.erase(region);
  }
  std::map<uint32_t, std::optional<int64_t>> previous_latest;
  for (const auto& [rank_id, regions] : removed) {
    RankState& rank_state = ranks_[rank_id];
    previous_latest[rank_id] = rank_state.latest_committed;
    std::optional<int64_t> latest;
    for (const auto& [region, version] : rank_state.committed) {
      latest = std::max(latest.value_or(version->step), version->step);
    }
    rank_state.latest_committed = latest;
  }
  if (absl::Status status = WriteJournal({}, *cluster_, *cluster_image_bytes_); !status.ok()) {
    for (auto& [rank_id, regions] : removed) {
      RankState& rank_state = ranks_[rank_id];
      for (auto& [region, version] : regions) rank_state.committed[region] = std::move(version);
      rank_state.latest_committed = previous_latest[rank_id];
    }
    return status;
  }
  Log(LogLevel::kInfo, "dropped ", response.versions_dropped(), " versions of step ", step);
  return response;  // `removed` goes out of scope here and frees the extents
}

}  // namespace moesnap::daemon
