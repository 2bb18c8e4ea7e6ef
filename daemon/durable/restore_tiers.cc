// RestoreTiers: the tier decision fed with this node's and the peers' state, and each answer
// served from the tier chosen.
#include "daemon/durable/restore_tiers.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "daemon/durable/disk_restore.h"
#include "daemon/durable/step_reader.h"

namespace moesnap::daemon::durable {
namespace {

// A question to the other nodes waits this long at most per attempt.
constexpr absl::Duration kSurveyTimeout = absl::Seconds(2);
constexpr absl::Duration kRetryInterval = absl::Milliseconds(200);
// Exported bytes travel in messages of at most this size (gRPC's default limit is 4 MiB).
constexpr uint64_t kExportPieceBytes = uint64_t{1} << 20;

// The committed step of the node's image: the cluster's, or on a single node the lowest of its
// ranks' (absent when nothing is committed).
std::optional<int64_t> ImageStep(const v1::NodeImage& manifest, const v1::JournalCluster& cluster) {
  if (cluster.has_committed_step()) return cluster.committed_step();
  std::optional<int64_t> lowest;
  for (const v1::JournalRank& rank : manifest.ranks()) {
    lowest = std::min(lowest.value_or(rank.latest_committed_step()), rank.latest_committed_step());
  }
  return lowest;
}

// Sends one region's bytes, chunk by chunk as `read` gives them, in pieces within chunks.
absl::Status SendRegion(uint32_t index, const v1::ImageRegion& region,
                        const std::function<absl::Status(uint32_t chunk, uint8_t* out)>& read,
                        const std::function<bool(const v1::ExportChunk&)>& send) {
  std::vector<uint8_t> buffer(std::min(region.chunk_bytes(), region.bytes()));
  v1::ExportChunk message;
  v1::ExportData* data = message.mutable_data();
  data->set_region(index);
  for (int chunk = 0; chunk < region.chunk_crcs_size(); ++chunk) {
    const uint64_t start = uint64_t(chunk) * region.chunk_bytes();
    const uint64_t length = std::min(region.chunk_bytes(), region.bytes() - start);
    if (absl::Status status = read(static_cast<uint32_t>(chunk), buffer.data()); !status.ok()) {
      return status;
    }
    for (uint64_t piece = 0; piece < length; piece += kExportPieceBytes) {
      data->set_offset(start + piece);
      data->set_data(buffer.data() + piece, std::min(kExportPieceBytes, length - piece));
      if (!send(message)) return absl::CancelledError("the receiver went away");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TierChoice> RestoreTiers::ChooseOnce(uint32_t rank, absl::Time deadline) {
  TierInputs inputs;
  inputs.memory_problem = view_->WaitMemory(deadline);
  if (absl::IsUnavailable(inputs.memory_problem) ||
      absl::IsDeadlineExceeded(inputs.memory_problem)) {
    return inputs.memory_problem;  // still rebuilding: nothing is known yet
  }
  inputs.memory_here = inputs.memory_problem.ok() && store_->LatestCommitted(rank).has_value();
  absl::StatusOr<std::vector<int64_t>> steps = drainer_->directory().Steps();
  if (steps.ok()) {
    inputs.durable_here = *std::move(steps);
  } else {
    Log(LogLevel::kWarning, "durable tier: cannot list ", drainer_->directory().path(), ": ",
        steps.status().message());
  }
  // Without a durable step here the answer is memory's whatever the others hold; with one, the
  // others say whether memory still serves the job, and the cluster's records which step is
  // durable on every node when it does not.
  if (!inputs.durable_here.empty() && inputs.memory_here) {
    inputs.peers = view_->SurveyMemory(std::min(deadline, absl::Now() + kSurveyTimeout));
  }
  return ChooseTier(inputs, [&] { return view_->NewestDurableEverywhere(inputs.durable_here); });
}

absl::StatusOr<TierChoice> RestoreTiers::Choose(uint32_t rank, absl::Time deadline) {
  while (true) {
    absl::StatusOr<TierChoice> choice = ChooseOnce(rank, deadline);
    if (!absl::IsUnavailable(choice.status()) || absl::Now() + kRetryInterval >= deadline) {
      return choice;
    }
    absl::SleepFor(kRetryInterval);
  }
}

absl::StatusOr<v1::LatestCommittedResponse> RestoreTiers::LatestCommitted(uint32_t rank,
                                                                        absl::Time deadline) {
  v1::LatestCommittedResponse response;
  auto from_memory = [&]() -> absl::StatusOr<v1::LatestCommittedResponse> {
    // A step still capturing (its trainer may be gone) or being decided settles first: the answer
    // is the step a restore would give.
    if (absl::Status settled = store_->WaitSettled(rank, deadline); !settled.ok()) return settled;
    if (std::optional<int64_t> latest = store_->LatestCommitted(rank)) {
      response.set_step(*latest);
      response.set_tier(v1::TIER_MEMORY);
    }
    v1::RankWindows windows = store_->Windows(rank);
    if (windows.has_committed_window()) {
      *response.mutable_committed_window() = std::move(*windows.mutable_committed_window());
    }
    if (windows.has_open_window()) {
      *response.mutable_open_window() = std::move(*windows.mutable_open_window());
    }
    return response;
  };
  if (drainer_ == nullptr) {
    if (absl::Status status = view_->WaitMemory(deadline); !status.ok()) return status;
    return from_memory();
  }
  absl::StatusOr<TierChoice> choice = Choose(rank, deadline);
  if (!choice.ok()) return choice.status();
  if (choice->tier == v1::TIER_MEMORY) return from_memory();
  if (choice->tier != v1::TIER_DURABLE) return response;  // nothing to restore
  absl::StatusOr<std::unique_ptr<StepReader>> step =
      StepReader::Open(drainer_->directory(), *choice->step);
  if (!step.ok()) return step.status();
  const std::optional<v1::JournalRank> record = RankRecord((*step)->manifest(), rank);
  if (!record) return response;  // the rank has no state in the job's durable step
  response.set_step(record->latest_committed_step());
  response.set_tier(v1::TIER_DURABLE);
  if (record->has_committed_window()) *response.mutable_committed_window() = record->committed_window();
  if (record->has_open_window()) *response.mutable_open_window() = record->open_window();
  return response;
}

absl::StatusOr<v1::RestoreResponse> RestoreTiers::Restore(uint32_t rank, std::optional<int64_t> step,
                                                          const std::vector<std::string>& regions,
                                                          absl::Time deadline,
                                                          std::vector<GroupRegion>* remote) {
  auto from_memory = [&]() -> absl::StatusOr<v1::RestoreResponse> {
    absl::StatusOr<v1::RestoreResponse> restored = store_->Restore(rank, step, regions, deadline, remote);
    if (restored.ok()) restored->set_tier(v1::TIER_MEMORY);
    return restored;
  };
  if (drainer_ == nullptr) {
    if (absl::Status status = view_->WaitMemory(deadline); !status.ok()) return status;
    return from_memory();
  }
  absl::StatusOr<TierChoice> choice = Choose(rank, deadline);
  if (!choice.ok()) return choice.status();
  // Loads from disk take turns, and a restore from memory waits for the load in progress: a
  // replica group is loaded member by member, so memory may hold this rank's step before the
  // shards of the other members are in.
  absl::ReleasableMutexLock loading(&load_mutex_);
  if (choice->tier == v1::TIER_MEMORY) {
    loading.Release();
    return from_memory();
  }
  if (choice->tier != v1::TIER_DURABLE) {
    return absl::NotFoundError(absl::StrCat("rank ", rank, " has nothing to restore: ",
                                            choice->reason));
  }
  if (step && *step != *choice->step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", *step, " cannot be restored: memory no longer holds the committed state and the "
        "newest step durable on every node is ", *choice->step));
  }
  // Steps after this one were written by the run this restore abandons.
  if (absl::Status status = drainer_->DiscardAfter(*choice->step); !status.ok()) {
    Log(LogLevel::kWarning, "durable tier: ", status.message());
  }
  // Into memory first (unless memory holds that very step of the rank already: an earlier restore
  // loaded it, or the run committed it here), then restored from there like any committed state.
  absl::StatusOr<std::unique_ptr<StepReader>> reader =
      StepReader::Open(drainer_->directory(), *choice->step);
  if (!reader.ok()) return reader.status();
  const std::optional<v1::JournalRank> record = RankRecord((*reader)->manifest(), rank);
  if (!record) {
    return absl::NotFoundError(absl::StrCat("rank ", rank, " has nothing in durable step ",
                                            *choice->step, ", the newest durable on every node"));
  }
  if (store_->LatestCommitted(rank) != record->latest_committed_step()) {
    Log(LogLevel::kInfo, "rank ", rank, " restores from the durable tier: ", choice->reason);
    if (absl::Status status = LoadRankFromDisk(store_, **reader, rank); !status.ok()) return status;
    view_->StateLoaded();
  }
  // A replica group's regions are assembled from every member's shard: the members this node
  // held, lost from memory too, come from the same durable step.
  for (const v1::ReplicaGroupStep& layout : record->replica_groups()) {
    for (uint32_t member : layout.group().ranks()) {
      const std::optional<v1::JournalRank> theirs = RankRecord((*reader)->manifest(), member);
      if (member == rank || !theirs ||
          store_->LatestCommitted(member) == theirs->latest_committed_step()) {
        continue;
      }
      if (absl::Status status = LoadRankFromDisk(store_, **reader, member); !status.ok()) {
        return status;
      }
      view_->StateLoaded();
    }
  }
  loading.Release();
  absl::StatusOr<v1::RestoreResponse> restored = store_->Restore(rank, step, regions, deadline, remote);
  if (restored.ok()) restored->set_tier(v1::TIER_DURABLE);
  return restored;
}

absl::StatusOr<v1::RestoreTierResponse> RestoreTiers::Tier(uint32_t rank, absl::Time deadline) {
  v1::RestoreTierResponse response;
  if (drainer_ == nullptr) {
    if (absl::Status status = view_->WaitMemory(deadline); !status.ok()) return status;
    if (std::optional<int64_t> latest = store_->LatestCommitted(rank)) {
      response.set_tier(v1::TIER_MEMORY);
      response.set_step(*latest);
      response.set_reason("this daemon has no durable tier ([durable] directory is not set)");
    } else {
      response.set_reason("nothing is committed in memory and this daemon has no durable tier");
    }
    return response;
  }
  absl::StatusOr<TierChoice> choice = Choose(rank, deadline);
  if (!choice.ok()) return choice.status();
  response.set_tier(choice->tier);
  response.set_reason(choice->reason);
  if (choice->tier == v1::TIER_MEMORY) {
    if (std::optional<int64_t> latest = store_->LatestCommitted(rank)) response.set_step(*latest);
  } else if (choice->step) {
    response.set_step(*choice->step);
  }
  return response;
}

v1::DurableStatus RestoreTiers::DurableStatus() const {
  return drainer_ == nullptr ? v1::DurableStatus() : drainer_->Status();
}

v1::ListDurableResponse RestoreTiers::ListDurable() {
  v1::ListDurableResponse response;
  if (drainer_ == nullptr) return response;
  *response.mutable_status() = drainer_->Status();
  absl::StatusOr<std::vector<int64_t>> steps = drainer_->directory().Steps();
  if (!steps.ok()) {
    response.set_everywhere_unknown(std::string(steps.status().message()));
    return response;
  }
  absl::StatusOr<DurableEverywhere> newest = view_->NewestDurableEverywhere(*steps);
  std::optional<int64_t> everywhere;
  if (newest.ok()) {
    everywhere = newest->step;
    if (everywhere) response.set_newest_everywhere(*everywhere);
  } else {
    response.set_everywhere_unknown(std::string(newest.status().message()));
  }
  for (int64_t step : *steps) {
    v1::DurableStepInfo* info = response.add_steps();
    info->set_step(step);
    info->set_durable_everywhere(everywhere == step);
    if (absl::StatusOr<uint64_t> bytes = drainer_->directory().StepBytes(step); bytes.ok()) {
      info->set_bytes(*bytes);
    }
    absl::StatusOr<std::unique_ptr<StepReader>> reader =
        StepReader::Open(drainer_->directory(), step);
    if (!reader.ok()) {
      info->set_problem(std::string(reader.status().message()));
      continue;
    }
    const v1::DurableManifest& manifest = (*reader)->manifest();
    info->set_created_unix_ms(manifest.created_unix_ms());
    info->set_regions(static_cast<uint32_t>(manifest.regions_size()));
    for (const v1::DurableFile& file : manifest.files()) info->add_ranks(file.rank());
  }
  return response;
}

absl::Status RestoreTiers::Export(const v1::ExportRequest& request,
                                  const std::function<bool(const v1::ExportChunk&)>& send) {
  const NodeImage image = store_->CommittedImage();  // holds the versions while they are sent
  const std::optional<int64_t> memory_step = ImageStep(image.manifest(), *store_->ClusterRecord());
  bool from_memory = false;
  if (request.tier() == v1::TIER_MEMORY || request.tier() == v1::TIER_UNSPECIFIED) {
    from_memory = memory_step && (!request.has_step() || request.step() == *memory_step);
    if (!from_memory && request.tier() == v1::TIER_MEMORY) {
      return absl::NotFoundError(absl::StrCat(
          "memory holds ", memory_step ? absl::StrCat("step ", *memory_step) : "no committed step",
          request.has_step() ? absl::StrCat(", not step ", request.step()) : ""));
    }
  }
  v1::ExportChunk header_message;
  v1::ExportHeader* header = header_message.mutable_header();
  header->set_node_id(node_id_);
  std::unique_ptr<StepReader> reader;
  std::vector<int> selected;  // indices into the source's regions
  if (from_memory) {
    header->set_step(*memory_step);
    header->set_tier(v1::TIER_MEMORY);
    for (int i = 0; i < image.manifest().regions_size(); ++i) {
      const v1::ImageRegion& region = image.manifest().regions(i);
      if (request.has_rank() && region.rank() != request.rank()) continue;
      selected.push_back(i);
      *header->add_regions() = region;
    }
    for (const v1::JournalRank& rank : image.manifest().ranks()) {
      if (!request.has_rank() || rank.rank() == request.rank()) *header->add_ranks() = rank;
    }
  } else {
    if (drainer_ == nullptr) {
      return absl::NotFoundError(absl::StrCat(
          request.has_step() ? absl::StrCat("step ", request.step(), " is not in memory")
                             : "memory holds no committed step",
          " and this daemon has no durable tier"));
    }
    absl::StatusOr<std::vector<int64_t>> steps = drainer_->directory().Steps();
    if (!steps.ok()) return steps.status();
    int64_t step = 0;
    if (request.has_step()) {
      if (std::find(steps->begin(), steps->end(), request.step()) == steps->end()) {
        return absl::NotFoundError(absl::StrCat("step ", request.step(), " is neither in memory nor "
                                                "durable on this node"));
      }
      step = request.step();
    } else if (steps->empty()) {
      return absl::NotFoundError("no step is durable on this node");
    } else {
      step = steps->back();
    }
    absl::StatusOr<std::unique_ptr<StepReader>> opened = StepReader::Open(drainer_->directory(), step);
    if (!opened.ok()) return opened.status();
    reader = *std::move(opened);
    header->set_step(step);
    header->set_tier(v1::TIER_DURABLE);
    const v1::DurableManifest& manifest = reader->manifest();
    for (int i = 0; i < manifest.regions_size(); ++i) {
      const v1::ImageRegion& region = manifest.regions(i).region();
      if (request.has_rank() && region.rank() != request.rank()) continue;
      selected.push_back(i);
      *header->add_regions() = region;
    }
    for (const v1::JournalRank& rank : manifest.ranks()) {
      if (!request.has_rank() || rank.rank() == request.rank()) *header->add_ranks() = rank;
    }
  }
  uint64_t bytes = 0;
  for (const v1::ImageRegion& region : header->regions()) bytes += region.bytes();
  header->set_bytes(bytes);
  if (!send(header_message)) return absl::CancelledError("the receiver went away");
  for (size_t i = 0; i < selected.size(); ++i) {
    const v1::ImageRegion& region = header_message.header().regions(static_cast<int>(i));
    const int source = selected[i];
    absl::Status status = SendRegion(
        static_cast<uint32_t>(i), region,
        [&](uint32_t chunk, uint8_t* out) -> absl::Status {
          if (reader != nullptr) return reader->ReadChunk(source, chunk, out);
          const uint64_t start = uint64_t{chunk} * region.chunk_bytes();
          image.stored()[source]->Read(start, std::min(region.chunk_bytes(), region.bytes() - start),
                                       out);
          return absl::OkStatus();
        },
        send);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon::durable
