// Store: step state machine, chunked captures on the worker pool, journaled commits, sparse
// windows. Restores are in store_restore.cc, operators' views and DropStep in
// store_operations.cc, what the cluster asks of a node in store_cluster.cc.
#include "daemon/store.h"
#include "daemon/store_types.h"

#include <algorithm>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/byte_size.h"
#include "common/log.h"
#include "common/metrics.h"
#include "daemon/copy_plan.h"
#include "daemon/region_limits.h"
#include "daemon/shard_layout.h"
#include "daemon/task_transfers.h"
#include "proto/step_state_name.h"

namespace moesnap::daemon {
namespace {

// Per rank and step: how long captures and commits take, and how steps end. Registered when the
// program starts, so a scrape sees every series at zero.
struct StepMetrics {
  static StepMetrics& Get() {
    static StepMetrics* metrics = new StepMetrics();
    return *metrics;
  }
  metrics::Registry& registry = metrics::Registry::Default();
  metrics::Histogram& capture_seconds = registry.AddHistogram(
      "moesnap_capture_duration_seconds",
      "Time from Snapshot to every chunk of a rank's step copied and checksummed",
      metrics::DurationBuckets());
  metrics::Histogram& commit_seconds = registry.AddHistogram(
      "moesnap_commit_duration_seconds",
      "Time from a rank's step captured to committed (the journal write; in a cluster the commit "
      "round)",
      metrics::DurationBuckets());
  static constexpr char kSteps[] = "moesnap_steps_total";
  static constexpr char kStepsHelp[] = "Steps of a rank that ended, by outcome";
  metrics::Counter& committed = registry.AddCounter(kSteps, kStepsHelp, {{"outcome", "committed"}});
  metrics::Counter& aborted = registry.AddCounter(kSteps, kStepsHelp, {{"outcome", "aborted"}});
  metrics::Counter& superseded = registry.AddCounter(kSteps, kStepsHelp, {{"outcome", "superseded"}});
  // Never captured: Snapshot answered "skipped" (commits lagging, or no room in the pool).
  metrics::Counter& skipped = registry.AddCounter(kSteps, kStepsHelp, {{"outcome", "skipped"}});
};
[[maybe_unused]] const StepMetrics& step_metrics_at_start = StepMetrics::Get();

// Finished steps remembered per rank, so a late WaitCaptured still learns how its step ended.
constexpr size_t kFinishedStepsKept = 64;
constexpr absl::Duration kWaitPollInterval = absl::Milliseconds(100);

}  // namespace

Store::Store(Pool* pool, Journal* journal, CopyBackends backends, const CaptureOptions& options,
             CommitMode mode)
    : pool_(pool), journal_(journal), backends_(backends), options_(options), mode_(mode),
      workers_(options.threads) {}

Store::~Store() = default;

absl::StatusOr<std::unique_ptr<Store>> Store::Open(Pool* pool, Journal* journal,
                                                   CopyBackends backends,
                                                   const CaptureOptions& options,
                                                   CommitMode mode) {
  if (options.threads < 1 || options.threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("capture.threads must be in [1, 256], got ", options.threads));
  }
  if (options.chunk_bytes < 4096 || options.chunk_bytes > (uint64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "capture.chunk_bytes must be in [4 KiB, 1 GiB], got ", options.chunk_bytes));
  }
  std::unique_ptr<Store> store(new Store(pool, journal, backends, options, mode));
  if (absl::Status status = store->Recover(); !status.ok()) return status;
  return store;
}

absl::Status Store::Recover() {
  const v1::JournalState& state = journal_->recovered_state();
  absl::MutexLock lock(&mutex_);
  if (!pool_->reattached() && state.versions_size() > 0) {
    Log(LogLevel::kWarning, "the pool /dev/shm/", pool_->file_name(),
        " was created anew, so the ", state.versions_size(),
        " versions in the journal are gone; starting empty");
    return journal_->Write({});
  }
  for (const v1::JournalVersion& saved : state.versions()) {
    const auto entry = [&] {
      return absl::StrCat("journal entry for region '", saved.region().substr(0, 256), "' of rank ",
                          saved.rank(), " at step ", saved.step());
    };
    // Its chunks and piece size the loops and copies of every restore of it.
    if (absl::Status valid = CheckStoredRegion(saved); !valid.ok()) {
      return absl::DataLossError(absl::StrCat(entry(), ": ", valid.message()));
    }
    std::vector<ExtentAllocator::Range> extents;
    for (const v1::PoolSpan& span : saved.extents()) extents.push_back({span.offset(), span.bytes()});
    if (extents.empty()) {  // written by an earlier daemon: one extent
      std::optional<uint64_t> rounded = ExtentAllocator::RoundUp(saved.bytes(), pool_->capacity());
      extents.push_back({saved.pool_offset(), rounded.value_or(0)});
    }
    absl::StatusOr<std::shared_ptr<PoolBytes>> stored = pool_->ClaimBytes(extents, saved.bytes());
    if (!stored.ok()) {
      return absl::DataLossError(absl::StrCat(entry(), ": ", stored.status().message()));
    }
    ranks_[saved.rank()].committed[saved.region()] = VersionFrom(saved, *std::move(stored));
  }
  for (const v1::JournalRank& saved : state.ranks()) {
    RankState& rank_state = ranks_[saved.rank()];
    LoadRankRecord(saved, &rank_state);
  }
  cluster_ = std::make_shared<v1::JournalCluster>(state.cluster());
  cluster_image_bytes_ =
      std::make_shared<const std::vector<std::string>>(SerializedImages(*cluster_));
  notified_step_ = NodeCommittedStep();
  if (state.versions_size() > 0) {
    Log(LogLevel::kInfo, "recovered ", state.versions_size(), " committed versions of ",
        state.ranks_size(), " ranks from journal sequence ", journal_->sequence());
  }
  return absl::OkStatus();
}

CopyBackend* Store::BackendFor(v1::Device device) const {
  return device == v1::DEVICE_CUDA ? backends_.device : backends_.host;
}

absl::StatusOr<v1::SnapshotResponse> Store::Snapshot(
    uint32_t rank, int64_t step, const std::vector<std::string>& regions,
    const std::optional<v1::SparseSlot>& sparse, std::optional<AbandonMark> abandon_mark) {
  activity_.Active(rank);
  absl::MutexLock lock(&mutex_);
  auto rank_it = ranks_.find(rank);
  if (rank_it == ranks_.end() || rank_it->second.regions->regions.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " has no registered regions to snapshot"));
  }
  RankState& rank_state = rank_it->second;
  const std::shared_ptr<const RegionTable> table = rank_state.regions;
  if (rank_state.latest_snapshot && step <= *rank_state.latest_snapshot) {
    // A new process of the rank replaying a step its predecessor took: deterministic training
    // gives the same bytes, so the step stands as taken, and its outcome with it: committed, or
    // aborted (by the cluster, or its copy failed) once its predecessor had gone on to a later
    // step, which a rank's steps, taken in order, cannot go back before. The replay goes forward
    // as the steps did.
    if (auto it = rank_state.steps.find(step);
        rank_state.replay && rank_state.replay->Allows(step) && it != rank_state.steps.end() &&
        (!sparse || (it->second.sparse && it->second.sparse->buffer() == sparse->buffer()))) {
      rank_state.replay->last = step;
      return v1::SnapshotResponse();  // nothing to copy
    }
    if (rank_state.replay && rank_state.replay->last && step < *rank_state.replay->last) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", step, " of rank ", rank, " is before step ",
                       *rank_state.replay->last, ", the step its process replayed last"));
    }
    return absl::InvalidArgumentError(absl::StrCat("step ", step, " of rank ", rank,
                                                   " is not after step ",
                                                   *rank_state.latest_snapshot,
                                                   ", its latest snapshot"));
  }
  // A step past its predecessor's, whether it is captured, skipped or refused below: nothing is
  // replayed from here.
  rank_state.replay.reset();
  // The trainer went on before the last capture ended (it gave up waiting for it: the daemon slow,
  // or paused): that capture may hold bytes of this step, and is no snapshot.
  if (const StepRecord* capturing = rank_state.Capturing()) {
    AbortStep(rank_state, rank_state.steps.at(capturing->step),
              absl::AbortedError(absl::StrCat(
                  "its trainer took step ", step,
                  " before the capture ended, and may have changed its memory during the copy")));
  }

  absl::StatusOr<Selection> selection =
      SelectRegions(rank, rank_state, table, regions, sparse.has_value());
  if (!selection.ok()) return selection.status();
  if (sparse && !table->groups.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " holds regions of replica group '", table->groups.begin()->first,
        "': sparse snapshots of replica groups are not supported; snapshot them densely"));
  }
  const CopyPlan& plan = *selection->plan;
  absl::StatusOr<std::string> lagging = SkipReason(rank, rank_state, step, sparse, plan);
  if (!lagging.ok()) return lagging.status();
  if (!lagging->empty()) {
    return Skip(rank_state, rank, step, sparse, table, selection->regions, *lagging);
  }
  // The pool space of the whole step in one reservation; the copy threads cut it into versions. A
  // member whose shard is empty (more members than alignment units) copies nothing. A plan past
  // the whole pool has no parts either (PlanCopy), and the pool refuses it.
  const bool fits_pool = plan.space <= pool_->capacity();
  absl::StatusOr<std::shared_ptr<const PoolReservation>> reservation =
      plan.parts.empty() && fits_pool ? std::shared_ptr<const PoolReservation>()
                                      : pool_->Reserve(plan.space);
  if (!reservation.ok()) {
    return Skip(rank_state, rank, step, sparse, table, selection->regions,
                absl::StrCat("it needs ", plan.bytes, " bytes (", FormatByteSize(plan.bytes),
                             ") for ", selection->regions->size(), " regions: ",
                             reservation.status().message(),
                             fits_pool ? ""
                                       : "; that is more than the whole pool: no step of these "
                                         "regions fits until pool.bytes is larger"));
  }
  return StartCapture(rank, rank_state, step, sparse, table, *std::move(selection),
                      *std::move(reservation), std::move(abandon_mark));
}

absl::StatusOr<Store::Selection> Store::SelectRegions(
    uint32_t rank, const RankState& rank_state, const std::shared_ptr<const RegionTable>& table,
    const std::vector<std::string>& named, bool sparse) const {
  Selection selection{{table, &table->all}, table->plan_of_all};
  if (named.empty()) return selection;
  std::vector<uint32_t> chosen;
  for (const std::string& name : named) {
    const std::optional<uint32_t> index = table->Find(name);
    if (!index) {
      return absl::NotFoundError(absl::StrCat("rank ", rank, " has no registered region '", name,
                                              "' (", table->regions.size(),
                                              " regions are registered)"));
    }
    chosen.push_back(*index);
  }
  for (const auto& [earlier, record] : rank_state.steps) {
    if (sparse || record.sparse || record.state == v1::STEP_STATE_COMMITTED || record.discarded) {
      continue;
    }
    if (rank_state.latest_committed && earlier <= *rank_state.latest_committed) continue;
    if (record.table == table) {
      chosen.insert(chosen.end(), record.selection->begin(), record.selection->end());
      continue;
    }
    for (uint32_t index : *record.selection) {
      if (std::optional<uint32_t> now = table->Find(record.table->name(index))) {
        chosen.push_back(*now);
      }
    }
  }
  std::sort(chosen.begin(), chosen.end());
  chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
  // A member of a replica group copies only the regions its shard has a piece of.
  std::erase_if(chosen, [&](uint32_t index) { return table->pieces[index].bytes == 0; });
  if (chosen.size() == table->all.size()) return selection;
  auto regions = std::make_shared<const std::vector<uint32_t>>(std::move(chosen));
  selection.plan = std::make_shared<const CopyPlan>(PlanCopy(
      regions->size(), [&](uint32_t position) { return table->pieces[(*regions)[position]].bytes; },
      [this](uint32_t) { return options_.chunk_bytes; }, options_.chunk_bytes, pool_->capacity(),
      table->InMemoryOrder(regions->size(),
                           [&](uint32_t position) { return (*regions)[position]; })));
  selection.regions = std::move(regions);
  return selection;
}

absl::StatusOr<std::string> Store::SkipReason(uint32_t rank, RankState& rank_state, int64_t step,
                                              const std::optional<v1::SparseSlot>& sparse,
                                              const CopyPlan& plan) {
  // A slot out of order is refused before any reason to skip it: a skipped slot is recorded in
  // the rank's windows, which take only a slot that continues the open window.
  if (sparse) {
    if (absl::Status status = rank_state.windows.Check(rank, step, *sparse); !status.ok()) {
      return status;
    }
  }
  // The node offered this step to the cluster without this rank (left out: idle, or dropped): the
  // step commits that image, whose parity holds nothing of a capture taken now, so none is.
  if (prepared_steps_.contains(step)) {
    return absl::StrCat("step ", step, " was offered to the cluster without rank ", rank,
                        " (left out of it: idle, or dropped) and commits as offered; the rank's "
                        "next step is captured");
  }
  if (sparse) {
    if (const std::string failure = rank_state.windows.FailureOf(*sparse);
        sparse->slot() > 0 && !failure.empty()) {
      return absl::StrCat("the window from step ", sparse->window_first_step(),
                          " can no longer commit: ", failure);
    }
  } else {
    std::vector<int64_t> waiting;
    for (const auto& [earlier, record] : rank_state.steps) {
      if (!record.sparse && !IsFinished(record.state)) waiting.push_back(earlier);
    }
    if (options_.max_in_flight_steps > 0 &&
        waiting.size() >= static_cast<size_t>(options_.max_in_flight_steps)) {
      return absl::StrCat("steps ", absl::StrJoin(waiting, ", "),
                          " still wait for their commit (capture.max_in_flight_steps = ",
                          options_.max_in_flight_steps, "): commits lag behind training");
    }
  }
  if (const uint64_t kept = ParityReserveLocked();
      kept > 0 && !plan.parts.empty() && plan.space <= pool_->capacity() &&
      pool_->free_bytes() < SaturatingAdd(plan.space, kept)) {
    return absl::StrCat("it needs ", plan.bytes, " bytes (", FormatByteSize(plan.bytes),
                        ") and the pool keeps ", FormatByteSize(kept), " for the parity of "
                        "steps being encoded; ", FormatByteSize(pool_->free_bytes()),
                        " are free: commits lag behind training");
  }
  return std::string();
}

absl::StatusOr<v1::SnapshotResponse> Store::StartCapture(
    uint32_t rank, RankState& rank_state, int64_t step, const std::optional<v1::SparseSlot>& sparse,
    std::shared_ptr<const RegionTable> table, Selection selection,
    std::shared_ptr<const PoolReservation> reservation, std::optional<AbandonMark> abandon_mark) {
  if (sparse) {
    if (absl::Status added = rank_state.windows.Add(step, *sparse, v1::STEP_STATE_CAPTURING);
        !added.ok()) {
      return added;
    }
  }
  const CopyPlan& plan = *selection.plan;
  auto job = std::make_shared<CaptureJob>();
  job->abandon_mark = std::move(abandon_mark);
  job->rank = rank;
  job->step = step;
  job->table = table;
  job->in_flight = std::make_unique<const CopyInFlight>(rank_state.copies);
  job->parts_copying = plan.parts.size();
  job->selection = selection.regions;
  job->plan = selection.plan;
  job->reservation = std::move(reservation);
  job->versions = std::exchange(rank_state.spare_versions, {});
  job->versions.assign(selection.regions->size(), nullptr);
  for (uint32_t position : plan.large) {  // copied by several parts: made before any of them runs
    job->versions[position] = NewVersion(*job, position);
  }

  StepRecord record;
  record.step = step;
  record.started = absl::Now();
  record.bytes = plan.bytes;
  record.regions = static_cast<uint32_t>(selection.regions->size());
  record.whole = selection.regions.get() == &table->all;
  record.table = std::move(table);
  record.selection = std::move(selection.regions);
  record.sparse = sparse;
  record.capture = job.get();
  record.pending_parts = plan.parts.size();
  in_flight_bytes_ += record.bytes;
  rank_state.latest_snapshot = step;
  Log(LogLevel::kDebug, "rank ", rank, " step ", step, ": capturing ", record.regions,
      " regions, ", record.bytes, " bytes in ", plan.parts.size(), " parts");
  v1::SnapshotResponse response;
  response.set_bytes(record.bytes);
  StepRecord& started = rank_state.steps[step] = std::move(record);
  if (plan.parts.empty()) {
    FinishStep(rank_state, rank, started);
    return response;
  }
  std::vector<std::function<void()>> parts;
  parts.reserve(plan.parts.size());
  for (size_t part = 0; part < plan.parts.size(); ++part) {
    parts.push_back([this, job, part] { CapturePart(job, part); });
  }
  workers_.SubmitAll(std::move(parts));
  return response;
}

std::shared_ptr<Store::Version> Store::NewVersion(const CaptureJob& job, uint32_t position) const {
  const uint32_t index = (*job.selection)[position];
  const v1::RegionSpec& spec = job.table->regions[index].spec;
  const ShardPiece& piece = job.table->pieces[index];
  const RegionTable::TensorType& type = job.table->type(index);
  auto version = std::make_shared<Version>();
  version->rank = job.rank;
  version->region = job.table->name(index);
  version->step = job.step;
  version->bytes = piece.bytes;
  version->dtype = type.dtype;
  version->shape.assign(type.shape.begin(), type.shape.end());
  version->chunk_bytes = options_.chunk_bytes;
  version->chunk_crcs.assign((version->bytes + options_.chunk_bytes - 1) / options_.chunk_bytes, 0);
  version->stored = job.reservation->Take(job.plan->offsets[position], piece.bytes);
  if (spec.has_replica_group()) {
    version->replica_group = spec.replica_group().name();
    version->piece_offset = piece.offset;
    version->region_bytes = spec.bytes();
  }
  return version;
}

uint64_t Store::ParityReserveLocked() {
  if (options_.parity_share <= 0) return 0;
  uint64_t committed = 0;  // the largest image of the group's committed step
  for (const v1::NodeImage& image : cluster_->group_images()) {
    committed = std::max(committed, image.bytes());
  }
  uint64_t here = 0;  // what a whole step of every rank of this node captures
  for (const auto& [rank, rank_state] : ranks_) {
    if (rank_state.regions->plan_of_all) {
      here = SaturatingAdd(here, rank_state.regions->plan_of_all->bytes);
    }
  }
  const double largest = static_cast<double>(std::max(committed, here));
  return static_cast<uint64_t>(std::min(2 * options_.parity_share * largest,
                                         static_cast<double>(pool_->capacity())));
}

absl::StatusOr<v1::SnapshotResponse> Store::Skip(
    RankState& rank_state, uint32_t rank, int64_t step, const std::optional<v1::SparseSlot>& sparse,
    std::shared_ptr<const RegionTable> table,
    std::shared_ptr<const std::vector<uint32_t>> selection, const std::string& why) {
  if (sparse) {
    if (absl::Status added = rank_state.windows.Add(step, *sparse, v1::STEP_STATE_ABORTED);
        !added.ok()) {
      return added;
    }
    rank_state.windows.Fail(
        step, *sparse,
        absl::StrCat("slot ", sparse->slot(), " (step ", step, ") was skipped: ", why));
  }
  ++snapshots_skipped_;
  StepMetrics::Get().skipped.Add();
  last_skip_ = absl::StrCat("rank ", rank, ", step ", step, ": ", why);
  // Under a sustained lag every step is skipped: say so at the first and then ever more rarely.
  if ((snapshots_skipped_ & (snapshots_skipped_ - 1)) == 0) {
    Log(LogLevel::kWarning, "snapshot skipped (", snapshots_skipped_, " so far): ", last_skip_);
  }
  StepRecord record;
  record.step = step;
  record.state = v1::STEP_STATE_ABORTED;
  record.skipped = true;
  record.table = std::move(table);  // the changes a later step must take with it
  record.selection = std::move(selection);
  record.failure = absl::AbortedError(absl::StrCat("skipped: ", why));
  record.sparse = sparse;
  rank_state.steps[step] = std::move(record);
  TrimFinishedSteps(rank_state);
  step_changed_.SignalAll();
  v1::SnapshotResponse response;
  response.set_skipped(why);
  return response;
}

void Store::TrimFinishedSteps(RankState& rank_state) {
  while (rank_state.steps.size() > kFinishedStepsKept &&
         IsFinished(rank_state.steps.begin()->second.state)) {
    rank_state.steps.erase(rank_state.steps.begin());
  }
}

void Store::CapturePart(const std::shared_ptr<CaptureJob>& job, size_t part_index) {
  const CopyPlan::Part& part = job->plan->parts[part_index];
  // The part copies one chunk of a large version, or a run of small versions whole.
  std::vector<std::pair<uint32_t, uint32_t>> chunks;  // (position, chunk)
  chunks.reserve(part.chunks());
  TaskTransfers transfers;
  transfers.Reserve(part.chunks());
  auto add = [&](uint32_t position, uint32_t chunk) {
    const RegionTable::Region& region = job->table->regions[(*job->selection)[position]];
    const Version& version = *job->versions[position];
    const uint64_t offset = uint64_t{chunk} * version.chunk_bytes;
    transfers.AddChunk(region.backend, region.source.get(), version.piece_offset + offset,
                       *version.stored, offset, version.ChunkLength(chunk));
    chunks.emplace_back(position, chunk);
  };
  if (part.chunk) {
    add(job->plan->order[part.first], *part.chunk);
  } else {
    for (uint32_t at = part.first; at < part.last; ++at) {
      const uint32_t position = job->plan->order[at];
      job->versions[position] = NewVersion(*job, position);
      add(position, 0);
    }
  }
  std::pair<size_t, size_t> failed;
  absl::Status failure = transfers.Run(
      [](CopyBackend& backend, std::span<Transfer> batch) { return backend.CopyOutBatch(batch); },
      [&](size_t index, uint32_t crc) {
        const auto [position, chunk] = chunks[index];
        job->versions[position]->chunk_crcs[chunk] = crc;
      },
      failed);
  if (!failure.ok()) {
    failure = NameFailedRun(
        failure, failed,
        [&](size_t index) {
          return std::pair<absl::string_view, uint32_t>(
              job->versions[chunks[index].first]->region, chunks[index].second);
        },
        "copy");
  }
  if (job->parts_copying.fetch_sub(1) == 1) job->in_flight.reset();

  absl::MutexLock lock(&mutex_);
  auto rank_it = ranks_.find(job->rank);
  if (rank_it == ranks_.end()) return;
  RankState& rank_state = rank_it->second;
  auto it = rank_state.steps.find(job->step);
  // The step may have ended meanwhile (aborted, or dropped and its number taken again).
  if (it == rank_state.steps.end() || it->second.capture != job.get() ||
      it->second.state != v1::STEP_STATE_CAPTURING) {
    return;
  }
  StepRecord& record = it->second;
  if (!failure.ok()) {
    AbortStep(rank_state, record, std::move(failure));
    return;
  }
  if (--record.pending_parts == 0) {
    // Every part has copied; bytes the trainer may have changed meanwhile are no snapshot.
    if (job->abandon_mark && job->abandon_mark->Abandoned()) {
      AbortStep(rank_state, record,
                absl::AbortedError("its trainer gave up waiting for the capture (its wait ran "
                                   "out, the daemon did not answer, or it closed its client) and "
                                   "may have changed its memory during the copy"));
      return;
    }
    record.versions = std::move(job->versions);
    FinishStep(rank_state, job->rank, record);
  }
}

void Store::FinishStep(RankState& rank_state, uint32_t rank, StepRecord& record) {
  record.state = v1::STEP_STATE_CAPTURED;
  record.captured_time = absl::Now();
  StepMetrics::Get().capture_seconds.Observe(absl::ToDoubleSeconds(record.captured_time - record.started));
  if (record.sparse) rank_state.windows.Mark(record.step, *record.sparse, record.state);
  v1::RankCapture& capture = rank_state.last_capture.emplace();
  capture.set_rank(rank);
  capture.set_step(record.step);
  capture.set_bytes(record.bytes);
  for (const RegionTable::Region& region : record.table->regions) {
    capture.set_state_bytes(SaturatingAdd(capture.state_bytes(), region.spec.bytes()));
  }
  if (mode_ == CommitMode::kCluster || !record.table->groups.empty()) {
    record.captured = true;  // on a single node the journal write below is part of the capture
    step_changed_.SignalAll();
  }
  // In a cluster, the cluster finds it through WaitNewNodeCapture.
  if (mode_ == CommitMode::kCluster) return;
  // On a single node a captured step is ready to commit: the journal write is the commit point.
  // A member of a replica group holds one shard: its step commits with every member's, once the
  // last of them has captured it.
  std::map<uint32_t, const StepRecord*> committing{{rank, &record}};
  if (!record.table->groups.empty() && !GroupCaptured(rank, record.step, &committing)) return;
  if (absl::Status status = WriteJournal(committing, *cluster_, *cluster_image_bytes_);
      !status.ok()) {
    for (const auto& [member, member_record] : committing) {
      RankState& member_state = ranks_[member];
      AbortStep(member_state, member_state.steps[member_record->step], status);
    }
    return;
  }
  for (const auto& [member, member_record] : committing) {
    RankState& member_state = ranks_[member];
    // Earlier captured steps of the members wait for a member that never captured them: this
    // step supersedes them.
    for (auto& [older, older_record] : member_state.steps) {
      if (older < record.step && !IsFinished(older_record.state)) {
        ++steps_superseded_;
        AbortStep(member_state, older_record,
                  absl::AbortedError(absl::StrCat("superseded by step ", record.step)),
                  StepOutcome::kSuperseded);
      }
    }
    CommitRecord(member_state, member, member_state.steps[member_record->step]);
  }
}

bool Store::GroupCaptured(uint32_t rank, int64_t step,
                          std::map<uint32_t, const StepRecord*>* committing) const {
  // Every member of every group of the ranks gathered so far, until no new member turns up.
  std::vector<uint32_t> pending{rank};
  while (!pending.empty()) {
    const uint32_t next = pending.back();
    pending.pop_back();
    const StepRecord& record = *committing->at(next);
    for (const auto& [name, group] : record.table->groups) {
      for (uint32_t member : group.ranks()) {
        if (committing->contains(member)) continue;
        auto member_it = ranks_.find(member);
        if (member_it == ranks_.end()) return false;
        auto it = member_it->second.steps.find(step);
        if (it == member_it->second.steps.end() || it->second.state != v1::STEP_STATE_CAPTURED) {
          return false;
        }
        auto same = it->second.table->groups.find(name);
        if (same == it->second.table->groups.end() || !SameMembers(same->second, group)) {
          return false;  // the member declared another group: its step cannot complete this one
        }
        committing->emplace(member, &it->second);
        pending.push_back(member);
      }
    }
  }
  return true;
}

void Store::CommitRecord(RankState& rank_state, uint32_t rank, StepRecord& record) {
  // The versions come in name order (but for sparse aliases): the place after the one before is
  // the hint, so a step of thousands of regions does not search the map for each.
  auto hint = rank_state.committed.begin();
  for (std::shared_ptr<Version>& version : record.versions) {
    const std::string& region = version->region;
    hint = std::next(rank_state.committed.insert_or_assign(hint, region, std::move(version)));
  }  // each frees the older version of its region
  record.versions.clear();
  if (record.versions.capacity() > rank_state.spare_versions.capacity()) {
    rank_state.spare_versions = std::move(record.versions);
  }
  CommitReplicaGroups(record, &rank_state.committed, &rank_state.replica_groups);
  record.state = v1::STEP_STATE_COMMITTED;
  if (record.captured_time != absl::Time()) {  // captured by this process, not recovered
    StepMetrics::Get().commit_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - record.captured_time));
  }
  StepMetrics::Get().committed.Add();
  rank_state.latest_committed = record.step;
  if (record.sparse) rank_state.windows.Commit(record.step, *record.sparse);
  in_flight_bytes_ -= record.bytes;
  Log(LogLevel::kDebug,
      LogFields{.step = record.step,
                .rank = rank,
                .duration_seconds = absl::ToDoubleSeconds(absl::Now() - record.started)},
      "rank ", rank, " step ", record.step, ": committed");
  // In a cluster the node's step moves once every rank's versions are in (CommitNodeStep).
  if (mode_ == CommitMode::kLocal) NotifyCommitted();
  step_changed_.SignalAll();
  TrimFinishedSteps(rank_state);
}

void Store::AbortStep(RankState& rank_state, StepRecord& record, absl::Status why,
                      StepOutcome outcome) {
  Log(LogLevel::kWarning, LogFields{.step = record.step}, "step ", record.step, " aborted: ",
      why.ToString());
  (outcome == StepOutcome::kSuperseded ? StepMetrics::Get().superseded : StepMetrics::Get().aborted).Add();
  record.state = v1::STEP_STATE_ABORTED;
  record.failure = std::move(why);
  record.versions.clear();  // chunks still copying hold their version until they finish
  in_flight_bytes_ -= record.bytes;
  if (record.sparse) {
    rank_state.windows.Fail(record.step, *record.sparse,
                            absl::StrCat("slot ", record.sparse->slot(), " (step ", record.step,
                                         ") aborted: ", record.failure.message()));
  }
  // The step never became the rank's latest, so the next snapshot may reuse its step number; steps
  // captured after it still count.
  rank_state.latest_snapshot = rank_state.latest_committed;
  for (const auto& [step, other] : rank_state.steps) {
    if (other.state != v1::STEP_STATE_ABORTED) {
      rank_state.latest_snapshot = std::max(rank_state.latest_snapshot.value_or(step), step);
    }
  }
  step_changed_.SignalAll();
}

absl::StatusOr<v1::StepState> Store::WaitFor(uint32_t rank, int64_t step, bool until_committed,
                                             absl::Time deadline,
                                             const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mutex_);
  while (true) {
    auto rank_it = ranks_.find(rank);
    if (rank_it == ranks_.end()) {
      return absl::NotFoundError(absl::StrCat("rank ", rank, " has never connected to this daemon"));
    }
    const RankState& rank_state = rank_it->second;
    auto it = rank_state.steps.find(step);
    if (it != rank_state.steps.end()) {
      const StepRecord& record = it->second;
      if (record.state == v1::STEP_STATE_ABORTED) {
        // Copied, then aborted by the cluster, or skipped: the trainer may go on, its regions are
        // free.
        if (!until_committed && (record.captured || record.skipped)) return record.state;
        return absl::Status(record.failure.code(),
                            absl::StrCat("step ", step, " of rank ", rank, " failed: ",
                                         record.failure.message()));
      }
      if (record.state == v1::STEP_STATE_COMMITTED ||
          (!until_committed && record.state != v1::STEP_STATE_CAPTURING)) {
        return record.state;
      }
    } else if (rank_state.latest_committed && step <= *rank_state.latest_committed &&
               (rank_state.steps.empty() || step < rank_state.steps.begin()->first)) {
      return v1::STEP_STATE_COMMITTED;  // older than the steps remembered, and superseded
    } else {
      return absl::NotFoundError(absl::StrCat("rank ", rank, " has no snapshot of step ", step));
    }
    if (cancelled()) return absl::CancelledError("the caller went away");
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("step ", step, " of rank ", rank, " is still ",
                                                      StepStateName(it->second.state)));
    }
    step_changed_.WaitWithDeadline(&mutex_, std::min(deadline, now + kWaitPollInterval));
  }
}

absl::StatusOr<v1::StepState> Store::WaitCaptured(uint32_t rank, int64_t step, absl::Time deadline,
                                                  const std::function<bool()>& cancelled) {
  return WaitFor(rank, step, /*until_committed=*/false, deadline, cancelled);
}

absl::StatusOr<v1::StepState> Store::WaitCommitted(uint32_t rank, int64_t step, absl::Time deadline,
                                                   const std::function<bool()>& cancelled) {
  return WaitFor(rank, step, /*until_committed=*/true, deadline, cancelled);
}


absl::Status Store::AwaitSettled(uint32_t rank, const RankState& rank_state, absl::Time deadline) {
  while (const StepRecord* capturing = rank_state.Capturing()) {
    if (step_changed_.WaitWithDeadline(&mutex_, deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "step ", capturing->step, " of rank ", rank, " is still capturing; restore after it"));
    }
  }
  // A step this rank captured that the node voted to commit may still commit: a restore takes it
  // or the step before it only once the cluster decided, so that ranks restarting together
  // cannot restore different steps (one before the decision, one after).
  while (const std::optional<int64_t> pending = PreparedStepOf(rank_state)) {
    if (step_changed_.WaitWithDeadline(&mutex_, deadline)) {
      return absl::UnavailableError(absl::StrCat(
          "step ", *pending, " of rank ", rank, " is being decided by the cluster (this node "
          "voted to commit it); restore again once it is decided"));
    }
  }
  return absl::OkStatus();
}

absl::Status Store::WaitSettled(uint32_t rank, absl::Time deadline) {
  absl::MutexLock lock(&mutex_);
  auto it = ranks_.find(rank);
  return it == ranks_.end() ? absl::OkStatus() : AwaitSettled(rank, it->second, deadline);
}

std::optional<int64_t> Store::LatestCommitted(uint32_t rank) const {
  absl::MutexLock lock(&mutex_);
  auto it = ranks_.find(rank);
  return it == ranks_.end() ? std::nullopt : it->second.latest_committed;
}

v1::RankWindows Store::Windows(uint32_t rank) const {
  absl::MutexLock lock(&mutex_);
  auto it = ranks_.find(rank);
  if (it == ranks_.end()) return SparseWindows().Describe(rank);
  return it->second.windows.Describe(rank);
}

v1::ListWindowsResponse Store::ListWindows(std::optional<uint32_t> rank) const {
  v1::ListWindowsResponse response;
  absl::MutexLock lock(&mutex_);
  for (const auto& [rank_id, rank_state] : ranks_) {
    if ((!rank || *rank == rank_id) && !rank_state.windows.empty()) {
      *response.add_ranks() = rank_state.windows.Describe(rank_id);
    }
  }
  return response;
}

std::optional<int64_t> Store::LogRecoveryPoint(const std::set<uint32_t>& ranks) const {
  absl::MutexLock lock(&mutex_);
  std::optional<int64_t> point;
  for (const auto& [rank, rank_state] : ranks_) {
    if (!ranks.contains(rank)) continue;
    int64_t rank_point;
    if (rank_state.windows.committed()) {
      rank_point = rank_state.windows.committed()->first_step();
    } else if (rank_state.windows.open()) {
      return std::nullopt;  // its first window has not committed: it would replay from the start
    } else if (rank_state.latest_committed) {
      rank_point = *rank_state.latest_committed;
    } else {
      return std::nullopt;  // never snapshotted: its recovery would start from the beginning
    }
    point = std::min(point.value_or(rank_point), rank_point);
  }
  return point;
}

std::optional<v1::JournalRank> Store::RankRecordAfter(uint32_t rank, const RankState& rank_state,
                                                      const StepRecord* committing) {
  std::optional<int64_t> latest = rank_state.latest_committed;
  SparseWindows windows = rank_state.windows;
  std::map<std::string, v1::ReplicaGroupStep> groups = rank_state.replica_groups;
  if (committing != nullptr) {
    latest = committing->step;
    if (committing->sparse) windows.Commit(committing->step, *committing->sparse);
    CommitReplicaGroups(*committing, nullptr, &groups);
  }
  if (!latest) return std::nullopt;
  v1::JournalRank saved;
  saved.set_rank(rank);
  saved.set_latest_committed_step(*latest);
  windows.SaveTo(&saved);
  for (const auto& [name, group] : groups) *saved.add_replica_groups() = group;
  return saved;
}

void Store::CommitReplicaGroups(const StepRecord& record,
                                CommittedVersions* committed,
                                std::map<std::string, v1::ReplicaGroupStep>* groups) {
  if (record.whole) groups->clear();  // the step is the rank's whole state: its groups now
  for (const auto& [name, group] : record.table->groups) {
    v1::ReplicaGroupStep& layout = (*groups)[name];
    *layout.mutable_group() = group;
    layout.set_step(record.step);
  }
  // After a whole step, a piece of an earlier step is one the rank's shard no longer covers (the
  // group changed size): kept, it would overlap the member that covers it now.
  if (committed == nullptr || !record.whole) return;
  std::erase_if(*committed, [&](const auto& entry) {
    return entry.second->is_piece() && entry.second->step < record.step;
  });
}

void Store::LoadRankRecord(const v1::JournalRank& saved, RankState* rank_state) {
  rank_state->latest_committed = saved.latest_committed_step();
  rank_state->latest_snapshot = saved.latest_committed_step();
  rank_state->windows = SparseWindows::LoadFrom(saved);
  rank_state->replica_groups.clear();
  for (const v1::ReplicaGroupStep& layout : saved.replica_groups()) {
    rank_state->replica_groups[layout.group().name()] = layout;
  }
}

}  // namespace moesnap::daemon
