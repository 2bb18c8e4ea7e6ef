// Store: what the cluster asks of a node's store: the node's capture of a step, its committed
// image, committing or aborting a decided step, installing a rebuilt image, regions written by a
// remote restore.
#include "daemon/store.h"
#include "daemon/store_types.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/copy_plan.h"
#include "proto/restored_regions.h"
#include "proto/step_state_name.h"

namespace moesnap::daemon {

absl::StatusOr<std::vector<uint32_t>> Store::RanksStillCapturing(int64_t step) const {
  std::vector<uint32_t> waiting;
  // The members of the replica groups that the trainers here declare: a member whose trainer is
  // gone (killed mid-step) is waited for all the same, so that no step commits without its shard.
  std::set<uint32_t> members;
  for (const auto& [rank, rank_state] : ranks_) {
    for (const auto& [name, group] : rank_state.regions->groups) {
      members.insert(group.ranks().begin(), group.ranks().end());
    }
  }
  for (const auto& [rank, rank_state] : ranks_) {
    auto it = rank_state.steps.find(step);
    const bool took_step = it != rank_state.steps.end() && !it->second.discarded;
    if (took_step && it->second.state == v1::STEP_STATE_ABORTED) {
      return absl::Status(it->second.failure.code(),
                          absl::StrCat("rank ", rank, ": ", it->second.failure.message()));
    }
    // A rank that took the step is part of it, however long its copy runs. One that did not and is
    // left out (idle, or dropped by an operator) is not: the step commits without it.
    if (!took_step && (!rank_state.regions->regions.empty() || rank_state.restarting) &&
        activity_.LeftOut(rank)) {
      continue;
    }
    // No trainer of this rank now (and none starting again): nothing to wait for, unless a
    // trainer here holds a replica group with it.
    if (rank_state.regions->regions.empty() && !rank_state.restarting && !members.contains(rank)) {
      continue;
    }
    if (it == rank_state.steps.end() || it->second.state != v1::STEP_STATE_CAPTURED) {
      waiting.push_back(rank);
    }
  }
  return waiting;
}

bool Store::AnyTrainerLocked() const {
  return std::any_of(ranks_.begin(), ranks_.end(),
                     [](const auto& rank) { return !rank.second.regions->regions.empty(); });
}

std::vector<uint32_t> Store::RanksWithoutCapture(int64_t step) const {
  std::vector<uint32_t> lacking;
  for (const auto& [rank, rank_state] : ranks_) {
    auto it = rank_state.steps.find(step);
    if (it == rank_state.steps.end() || it->second.discarded ||
        it->second.state != v1::STEP_STATE_CAPTURED) {
      lacking.push_back(rank);
    }
  }
  return lacking;
}

std::string Store::NotCapturedMessage(int64_t step) const {
  // NodeCaptured said no, without an error: either ranks still capture, or no trainer is here.
  const std::vector<uint32_t> waiting = RanksStillCapturing(step).value_or(std::vector<uint32_t>());
  if (!waiting.empty()) {
    return absl::StrCat("step ", step, " is not captured on this node: ranks [",
                        absl::StrJoin(waiting, ", "), "] have not snapshotted it");
  }
  if (ranks_.empty()) {
    return absl::StrCat("step ", step, " is not captured on this node: no rank is known here");
  }
  return absl::StrCat("step ", step,
                      " is not captured on this node: no trainer is registered, and ranks [",
                      absl::StrJoin(RanksWithoutCapture(step), ", "),
                      "] known here did not capture it before their trainers went");
}

absl::StatusOr<bool> Store::NodeCaptured(int64_t step) const {
  absl::StatusOr<std::vector<uint32_t>> waiting = RanksStillCapturing(step);
  if (!waiting.ok()) return waiting.status();
  if (!waiting->empty()) return false;
  if (AnyTrainerLocked() || options_.parity_only) return true;
  // No trainer here now to say which ranks take the step: it is captured only if every rank the
  // node knows captured it, their trainers killed since (while commits lagged behind training).
  // A rank killed before it took the step (a replica group's member, its shard missing) keeps it
  // from committing.
  return !ranks_.empty() && RanksWithoutCapture(step).empty();
}

absl::StatusOr<int64_t> Store::WaitNewNodeCapture(absl::Time deadline) {
  absl::MutexLock lock(&mutex_);
  while (true) {
    std::set<int64_t> candidates;
    for (const auto& [rank, rank_state] : ranks_) {
      for (const auto& [step, record] : rank_state.steps) {
        if (record.state == v1::STEP_STATE_CAPTURED && !record.offered) candidates.insert(step);
      }
    }
    for (int64_t step : candidates) {
      if (absl::StatusOr<bool> captured = NodeCaptured(step); !captured.ok() || !*captured) continue;
      for (auto& [rank, rank_state] : ranks_) {
        if (auto it = rank_state.steps.find(step); it != rank_state.steps.end()) {
          it->second.offered = true;
        }
      }
      return step;
    }
    // Judged once more after the last wait, as in WaitNodeCaptured.
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("no new capture of a step on this node");
    }
    WaitStepChanged(deadline);
  }
}

NodeCapture Store::CaptureOf(int64_t step) const {
  absl::MutexLock lock(&mutex_);
  // A rank's failure of it is known now: its Prepare says why.
  if (absl::StatusOr<bool> captured = NodeCaptured(step); !captured.ok() || *captured) {
    return NodeCapture::kCaptured;
  }
  return PassedLocked(step) ? NodeCapture::kPassed : NodeCapture::kNotYet;
}

bool Store::PassedLocked(int64_t step) const {
  bool any_trainer = false;
  for (const auto& [rank, rank_state] : ranks_) {
    if ((!rank_state.regions->regions.empty() || rank_state.restarting) && activity_.LeftOut(rank)) {
      continue;
    }
    if (rank_state.restarting) return false;  // its trainer comes back
    if (rank_state.regions->regions.empty()) continue;
    if (!rank_state.latest_snapshot || *rank_state.latest_snapshot <= step) return false;
    any_trainer = true;
  }
  return any_trainer;
}

void Store::WaitStepChanged(absl::Time deadline) {
  const absl::Time idle_at = activity_.NextIdleAt().value_or(absl::InfiniteFuture());
  step_changed_.WaitWithDeadline(&mutex_, std::min(deadline, idle_at));
}

absl::Status Store::DropRank(uint32_t rank) {
  absl::MutexLock lock(&mutex_);
  auto it = ranks_.find(rank);
  if (it == ranks_.end() || (it->second.regions->regions.empty() && !it->second.restarting)) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " has no trainer registered on this node: nothing to drop"));
  }
  activity_.Drop(rank);
  step_changed_.SignalAll();
  return absl::OkStatus();
}

std::optional<int64_t> Store::PreparedStepOf(const RankState& rank_state) const {
  for (int64_t step : prepared_steps_) {
    auto it = rank_state.steps.find(step);
    if (it != rank_state.steps.end() && it->second.state == v1::STEP_STATE_CAPTURED) return step;
  }
  return std::nullopt;
}

absl::StatusOr<NodeImage> Store::WaitNodeCaptured(int64_t step, absl::Time deadline) {
  absl::MutexLock lock(&mutex_);
  while (true) {
    absl::StatusOr<bool> captured = NodeCaptured(step);
    if (!captured.ok()) return captured.status();
    if (*captured) break;
    // A rank that skipped it and went on (its record since trimmed) never captures it: waiting out
    // the deadline would hold the round, and the pool, for nothing.
    if (PassedLocked(step)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step, " is not captured on this node and never will be: its ranks went past it"));
    }
    // Judged once more after the last wait: a step captured as the deadline came is captured.
    if (absl::Now() >= deadline) return absl::DeadlineExceededError(NotCapturedMessage(step));
    WaitStepChanged(deadline);
  }
  // A step that captures a subset of regions is a consistent state only if every region it leaves
  // out is committed as of its latest change: an earlier step that changed one and did not commit
  // (aborted, or still waiting) leaves the trainer's bytes ahead of anything stored.
  // A slot of a sparse window is exempt: the window, not the step, is the consistent state, and
  // it commits only when every slot has. So is a step at or before the rank's latest committed
  // one, as in Snapshot: that commit, consistent itself, holds the step's changes; and a step of a
  // timeline a whole restore ended, whose changes that restore undid. Its regions may
  // since have left the rank's shard of a replica group (the group's cut moved when its members
  // changed), its pieces of them dropped with the old layout: another member holds them now.
  for (const auto& [rank, rank_state] : ranks_) {
    auto it = rank_state.steps.find(step);
    if (it == rank_state.steps.end() || it->second.sparse) continue;
    const StepRecord& captured = it->second;
    for (const auto& [earlier, record] : rank_state.steps) {
      if (earlier >= step || record.state == v1::STEP_STATE_COMMITTED || record.discarded) {
        continue;
      }
      if (rank_state.latest_committed && earlier <= *rank_state.latest_committed) continue;
      if (record.table == captured.table && captured.selection->size() == captured.table->all.size()) {
        continue;  // the step captures every region the earlier one could have changed
      }
      for (uint32_t index : *record.selection) {
        const std::string_view region = record.table->name(index);
        if (captured.Captures(region)) continue;
        auto committed = rank_state.committed.find(region);
        if (committed == rank_state.committed.end() || committed->second->step < earlier) {
          return absl::FailedPreconditionError(absl::StrCat(
              "step ", step, " of rank ", rank, " leaves out region '", std::string(region),
              "', which step ", earlier, " changed and did not commit; the rank's next full "
              "snapshot is the next consistent step"));
        }
      }
    }
  }
  // Built in the memory of an earlier step's image: a step that changed a few of the node's
  // thousands of regions writes those few entries.
  NodeImage image = NodeImage::BuiltIn(image_memory_, [&](NodeImage::Entries& entries) {
    mutex_.AssertHeld();  // the caller holds it; the analysis does not follow the call into BuiltIn
    v1::NodeImage& manifest = entries.manifest();
    manifest.set_step(step);
    for (const auto& [rank, rank_state] : ranks_) {
      const StepRecord* record = nullptr;
      if (auto it = rank_state.steps.find(step); it != rank_state.steps.end()) record = &it->second;
      ForEachVersionAfter(rank_state, record, [&](const Version& version) {
        entries.Add(version.serial, version.stored,
                    [&](v1::ImageRegion& entry) { version.Save(&entry); });
      });
      if (std::optional<v1::JournalRank> saved = RankRecordAfter(rank, rank_state, record)) {
        *manifest.add_ranks() = *std::move(saved);
      }
    }
  });
  prepared_steps_.insert(step);
  return image;
}

NodeImage Store::CommittedImage() const {
  absl::MutexLock lock(&mutex_);
  return CommittedImageLocked();
}

absl::StatusOr<std::vector<std::shared_ptr<PoolBytes>>> Store::CommittedBytesOf(
    const v1::NodeImage& image, absl::Span<const int> positions) const {
  std::vector<std::shared_ptr<PoolBytes>> stored(image.regions_size());
  absl::MutexLock lock(&mutex_);
  for (int position : positions) {
    if (position < 0 || position >= image.regions_size()) {
      return absl::InvalidArgumentError(absl::StrCat("position ", position, " of an image of ",
                                                     image.regions_size(), " regions"));
    }
    const v1::ImageRegion& named = image.regions(position);
    const Version* version = CommittedVersionLocked(named.rank(), named.region());
    if (version == nullptr || version->step != named.step() || version->bytes != named.bytes()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the record's image of step ", image.step(), " holds step ", named.step(),
          " of region '", named.region(), "' of rank ", named.rank(), " (", named.bytes(),
          " bytes) at position ", position, ", where this node's committed versions hold ",
          version == nullptr
              ? std::string("none")
              : absl::StrCat("step ", version->step, " (", version->bytes, " bytes)")));
    }
    stored[position] = version->stored;
  }
  return stored;
}

absl::StatusOr<ClusterStore::HeldRegion> Store::CommittedRegion(int64_t step, uint32_t rank,
                                                                const std::string& region) const {
  absl::MutexLock lock(&mutex_);
  if (!cluster_->has_committed_step() || cluster_->committed_step() != step) {
    return absl::FailedPreconditionError(absl::StrCat("step ", step, " is not the committed step"));
  }
  if (const Version* version = CommittedVersionLocked(rank, region)) {
    v1::ImageRegion entry;
    version->Save(&entry);
    return HeldRegion{std::move(entry), version->stored};
  }
  return absl::NotFoundError(absl::StrCat("no region '", region, "' of rank ", rank));
}

const Store::Version* Store::CommittedVersionLocked(uint32_t rank,
                                                    const std::string& region) const {
  auto rank_it = ranks_.find(rank);
  if (rank_it == ranks_.end()) return nullptr;
  auto version = rank_it->second.committed.find(region);
  return version == rank_it->second.committed.end() ? nullptr : version->second.get();
}

NodeImage Store::CommittedImageLocked() const {
  return NodeImage::Built([&](v1::NodeImage& manifest,
                              std::vector<std::shared_ptr<PoolBytes>>& stored) {
    mutex_.AssertHeld();  // the caller holds it; the analysis does not follow the call into Built
    if (cluster_->has_committed_step()) manifest.set_step(cluster_->committed_step());
    for (const auto& [rank, rank_state] : ranks_) {
      for (const auto& [name, version] : rank_state.committed) {
        version->Save(manifest.add_regions());
        stored.push_back(version->stored);
      }
      if (std::optional<v1::JournalRank> saved = RankRecordAfter(rank, rank_state, nullptr)) {
        *manifest.add_ranks() = *std::move(saved);
      }
    }
  });
}

std::optional<int64_t> Store::NodeCommittedStep() const {
  if (mode_ == CommitMode::kCluster) {
    return cluster_->has_committed_step() ? std::optional<int64_t>(cluster_->committed_step())
                                         : std::nullopt;
  }
  std::optional<int64_t> lowest;
  for (const auto& [rank, rank_state] : ranks_) {
    if (rank_state.latest_committed) {
      lowest = std::min(lowest.value_or(*rank_state.latest_committed), *rank_state.latest_committed);
    }
  }
  return lowest;
}

void Store::NotifyCommitted() {
  const std::optional<int64_t> step = NodeCommittedStep();
  if (!step || step == notified_step_) return;
  const std::optional<int64_t> previous = notified_step_;
  notified_step_ = step;
  if (commit_observer_ != nullptr) {
    commit_observer_->Committed(previous, *step, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return CommittedImageLocked();  // runs inside Committed, under mutex_
    });
  }
}

void Store::SetCommitObserver(CommitObserver* observer) {
  absl::MutexLock lock(&mutex_);
  commit_observer_ = observer;
}

absl::Status Store::AdoptCommitted(uint32_t rank, const std::vector<v1::ImageRegion>& regions,
                                   const v1::JournalRank& record, const ChunkSource& read) {
  // Read everything into new pool bytes first, outside the lock: a failure changes nothing.
  CommittedVersions adopted;
  std::vector<uint8_t> chunk_buffer;
  for (size_t i = 0; i < regions.size(); ++i) {
    const v1::ImageRegion& region = regions[i];
    absl::StatusOr<std::shared_ptr<PoolBytes>> stored = pool_->AllocateBytes(region.bytes());
    if (!stored.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat("no room to load region '", region.region(),
                                                       "' of rank ", rank, " (", region.bytes(),
                                                       " bytes): ", stored.status().message()));
    }
    chunk_buffer.resize(std::min(region.chunk_bytes(), region.bytes()));
    for (int chunk = 0; chunk < region.chunk_crcs_size(); ++chunk) {
      const uint64_t offset = uint64_t(chunk) * region.chunk_bytes();
      if (absl::Status status =
              read(static_cast<int>(i), static_cast<uint32_t>(chunk), chunk_buffer.data());
          !status.ok()) {
        return status;
      }
      (*stored)->Write(offset, chunk_buffer.data(),
                       std::min(region.chunk_bytes(), region.bytes() - offset));
    }
    adopted[region.region()] = VersionFrom(region, *std::move(stored));
  }
  absl::MutexLock lock(&mutex_);
  RankState& rank_state = ranks_[rank];
  if (const StepRecord* capturing = rank_state.Capturing()) {
    return absl::FailedPreconditionError(absl::StrCat("step ", capturing->step, " of rank ", rank,
                                                      " is capturing; restore after it"));
  }
  // What LoadRankRecord replaces, and the committed versions, put back if the journal refuses.
  RankState previous;
  previous.committed = std::move(rank_state.committed);
  previous.latest_committed = rank_state.latest_committed;
  previous.latest_snapshot = rank_state.latest_snapshot;
  previous.windows = std::move(rank_state.windows);
  previous.replica_groups = std::move(rank_state.replica_groups);
  rank_state.committed = std::move(adopted);
  LoadRankRecord(record, &rank_state);
  // In a cluster the group's parity covers the committed step this node had, not the loaded one:
  // the record goes, so that the next step is encoded whole.
  const bool record_goes = mode_ == CommitMode::kCluster;
  const std::shared_ptr<const v1::JournalCluster> kept =
      record_goes ? std::make_shared<v1::JournalCluster>() : cluster_;
  const std::shared_ptr<const std::vector<std::string>> kept_bytes =
      record_goes ? std::make_shared<std::vector<std::string>>() : cluster_image_bytes_;
  if (absl::Status status = WriteJournal({}, *kept, *kept_bytes); !status.ok()) {
    rank_state.committed = std::move(previous.committed);
    rank_state.latest_committed = previous.latest_committed;
    rank_state.latest_snapshot = previous.latest_snapshot;
    rank_state.windows = std::move(previous.windows);
    rank_state.replica_groups = std::move(previous.replica_groups);
    return status;
  }
  cluster_ = kept;
  cluster_image_bytes_ = kept_bytes;
  notified_step_ = NodeCommittedStep();  // loaded, not committed anew: nothing to drain
  step_changed_.SignalAll();
  return absl::OkStatus();
}


absl::StatusOr<std::shared_ptr<const v1::JournalCluster>> Store::CommitNodeStep(
    int64_t step, v1::JournalCluster cluster, std::vector<std::string> image_bytes) {
  // The record replaced lists every group member's image: it is freed after the lock is released,
  // as are its images' bytes.
  std::shared_ptr<const v1::JournalCluster> replaced;
  std::shared_ptr<const std::vector<std::string>> replaced_bytes;
  absl::MutexLock lock(&mutex_);
  std::map<uint32_t, const StepRecord*> committing;
  for (auto& [rank, rank_state] : ranks_) {
    auto it = rank_state.steps.find(step);
    if (it != rank_state.steps.end() && it->second.state == v1::STEP_STATE_CAPTURED) {
      committing[rank] = &it->second;
    }
  }
  if (absl::Status status = WriteJournal(committing, cluster, image_bytes); !status.ok()) {
    return status;
  }
  replaced =
      std::exchange(cluster_, std::make_shared<v1::JournalCluster>(std::move(cluster)));
  replaced_bytes = std::exchange(
      cluster_image_bytes_, std::make_shared<std::vector<std::string>>(std::move(image_bytes)));
  prepared_steps_.erase(prepared_steps_.begin(), prepared_steps_.upper_bound(step));
  for (auto& [rank, record] : committing) {
    RankState& rank_state = ranks_[rank];
    StepRecord& stored = rank_state.steps[record->step];
    // Older steps still captured were never committed by the cluster: the new step supersedes them.
    for (auto& [older, older_record] : rank_state.steps) {
      if (older < step && !IsFinished(older_record.state)) {
        ++steps_superseded_;
        AbortStep(rank_state, older_record,
                  absl::AbortedError(absl::StrCat("superseded by step ", step)),
                  StepOutcome::kSuperseded);
      }
    }
    CommitRecord(rank_state, rank, stored);
  }
  NotifyCommitted();
  step_changed_.SignalAll();
  return cluster_;
}

void Store::AbortNodeStep(int64_t step, const absl::Status& why) {
  absl::MutexLock lock(&mutex_);
  prepared_steps_.erase(step);
  step_changed_.SignalAll();
  for (auto& [rank, rank_state] : ranks_) {
    auto it = rank_state.steps.find(step);
    if (it != rank_state.steps.end() && !IsFinished(it->second.state)) {
      AbortStep(rank_state, it->second, why);
    }
  }
}

absl::Status Store::InstallImage(const NodeImage& image, v1::JournalCluster cluster) {
  std::map<uint32_t, RankState> rebuilt;
  for (int i = 0; i < image.manifest().regions_size(); ++i) {
    const v1::ImageRegion& region = image.manifest().regions(i);
    rebuilt[region.rank()].committed[region.region()] = VersionFrom(region, image.stored()[i]);
  }
  for (const v1::JournalRank& rank : image.manifest().ranks()) {
    LoadRankRecord(rank, &rebuilt[rank.rank()]);
  }
  auto image_bytes = std::make_shared<const std::vector<std::string>>(SerializedImages(cluster));
  std::shared_ptr<const v1::JournalCluster> replaced;  // freed, as `rebuilt`, after the lock
  absl::MutexLock lock(&mutex_);
  prepared_steps_.clear();  // the installed state decides from here
  // Registered regions (a trainer already waiting to restore) stay, with the trainer's session and
  // its copies in flight; everything stored is replaced.
  for (auto& [rank, rank_state] : ranks_) {
    RankState& installed = rebuilt[rank];
    installed.session = rank_state.session;
    installed.connected = rank_state.connected;
    installed.regions = rank_state.regions;
    installed.restarting = rank_state.restarting;
    installed.copies = rank_state.copies;
  }
  std::swap(ranks_, rebuilt);
  if (absl::Status status = WriteJournal({}, cluster, *image_bytes); !status.ok()) {
    std::swap(ranks_, rebuilt);
    for (auto& [rank, rank_state] : rebuilt) ranks_[rank].regions = rank_state.regions;
    return status;
  }
  replaced =
      std::exchange(cluster_, std::make_shared<v1::JournalCluster>(std::move(cluster)));
  std::swap(cluster_image_bytes_, image_bytes);  // the replaced bytes, freed after the lock
  notified_step_ = NodeCommittedStep();  // a rebuilt step is not a new commit: nothing to drain
  step_changed_.SignalAll();
  return absl::OkStatus();
}

void Store::ForgetClusterRecord() {
  std::shared_ptr<const v1::JournalCluster> forgotten = std::make_shared<v1::JournalCluster>();
  std::shared_ptr<const std::vector<std::string>> forgotten_bytes =
      std::make_shared<std::vector<std::string>>();
  absl::MutexLock lock(&mutex_);
  std::swap(cluster_, forgotten);  // the old record, freed after the lock
  std::swap(cluster_image_bytes_, forgotten_bytes);
  notified_step_ = NodeCommittedStep();  // none: nothing to drain
  step_changed_.SignalAll();
}

absl::StatusOr<uint64_t> CommitJournalBound(const NodeImage& own, int own_position,
                                            const std::vector<std::string>& group_images,
                                            uint64_t stripes) {
  if (own_position < 0 || static_cast<size_t>(own_position) >= group_images.size()) {
    return absl::InvalidArgumentError(absl::StrCat("position ", own_position, " of ",
                                                   group_images.size(), " group images"));
  }
  // A version is its region's image entry and its pool extents (a PoolSpan of two varints, with
  // tags and length, each), in a field of its own.
  constexpr uint64_t kVersionFieldBytes = 8;
  constexpr uint64_t kExtentBytes = 24;
  // A parity record: four fields of at most ten bytes each, its tag and length.
  constexpr uint64_t kParityRecordBytes = 48;
  constexpr uint64_t kFieldBytes = 16;  // a message field's tag and length
  // The images come from a peer: sizes are summed without wrapping.
  auto times = [](uint64_t count, uint64_t each) {
    return count > std::numeric_limits<uint64_t>::max() / each
               ? std::numeric_limits<uint64_t>::max()
               : count * each;
  };
  uint64_t bytes = SaturatingAdd(kFieldBytes, group_images[own_position].size());
  bytes = SaturatingAdd(bytes, times(own.stored().size(), kVersionFieldBytes));
  bytes = SaturatingAdd(bytes, times(own.pool_extents(), kExtentBytes));
  for (const std::string& image : group_images) {
    bytes = SaturatingAdd(bytes, SaturatingAdd(image.size(), kFieldBytes));
  }
  return SaturatingAdd(bytes, times(stripes, kParityRecordBytes));
}

absl::Status Store::JournalRoomFor(const NodeImage& own, int own_position,
                                   const std::vector<std::string>& group_images,
                                   uint64_t stripes) const {
  const absl::StatusOr<uint64_t> bound =
      CommitJournalBound(own, own_position, group_images, stripes);
  if (!bound.ok()) return bound.status();
  absl::MutexLock lock(&mutex_);
  return journal_->Room(*bound);
}

std::shared_ptr<const v1::JournalCluster> Store::ClusterRecord() const {
  absl::MutexLock lock(&mutex_);
  return cluster_;
}

ClusterStore::RecordWithBytes Store::ClusterRecordWithBytes() const {
  absl::MutexLock lock(&mutex_);
  return {cluster_, cluster_image_bytes_};
}

uint64_t Store::InFlightBytes() const {
  absl::MutexLock lock(&mutex_);
  return in_flight_bytes_;
}

uint64_t Store::CommittedBytes() const {
  absl::MutexLock lock(&mutex_);
  uint64_t bytes = 0;
  for (const auto& [rank, rank_state] : ranks_) {
    for (const auto& [region, version] : rank_state.committed) bytes += version->bytes;
  }
  return bytes;
}

absl::Status Store::WriteRegion(uint32_t rank, const v1::ImageRegion& stored, const PoolBytes& bytes) {
  std::shared_ptr<RegionSource> source;
  CopyBackend* backend = nullptr;
  std::optional<CopyInFlight> in_flight;
  {
    absl::MutexLock lock(&mutex_);
    auto rank_it = ranks_.find(rank);
    const std::optional<uint32_t> index =
        rank_it == ranks_.end() ? std::nullopt : rank_it->second.regions->Find(stored.region());
    if (!index) {
      return absl::NotFoundError(absl::StrCat("rank ", rank, " has not registered region '",
                                              stored.region(), "' to restore into"));
    }
    const RegionTable::Region& registered = rank_it->second.regions->regions[*index];
    const v1::RegionSpec& spec = registered.spec;
    if (stored.chunk_bytes() == 0 || bytes.bytes() < stored.bytes() ||
        static_cast<uint64_t>(stored.chunk_crcs_size()) !=
            stored.bytes() / stored.chunk_bytes() + (stored.bytes() % stored.chunk_bytes() != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region '", stored.region(), "' of rank ", stored.rank(), " is described as ",
          stored.bytes(), " bytes in ", stored.chunk_crcs_size(), " chunks of ",
          stored.chunk_bytes(), " bytes with ", bytes.bytes(), " bytes at hand"));
    }
    const uint64_t region_bytes = stored.has_piece() ? stored.piece().region_bytes() : stored.bytes();
    if (spec.bytes() != region_bytes ||
        (stored.has_piece() && (stored.piece().offset() > region_bytes ||
                                stored.bytes() > region_bytes - stored.piece().offset()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region '", stored.region(), "' is ", spec.bytes(), " bytes in rank ", rank,
          ", but rank ", stored.rank(), " stored ", stored.bytes(), " bytes at offset ",
          stored.piece().offset(), " of ", region_bytes, " at step ", stored.step()));
    }
    if (!spec.dtype().empty() && !stored.dtype().empty() && spec.dtype() != stored.dtype()) {
      return absl::InvalidArgumentError(absl::StrCat("region '", stored.region(), "' is ",
                                                     spec.dtype(), " in rank ", rank, ", but rank ",
                                                     stored.rank(), " stored ", stored.dtype()));
    }
    source = registered.source;
    backend = registered.backend;
    in_flight.emplace(rank_it->second.copies);
  }
  const uint64_t piece_offset = stored.piece().offset();  // 0 for a whole region
  for (int chunk = 0; chunk < stored.chunk_crcs_size(); ++chunk) {
    const uint64_t offset = uint64_t(chunk) * stored.chunk_bytes();
    const uint64_t length = std::min(stored.chunk_bytes(), stored.bytes() - offset);
    absl::StatusOr<uint32_t> crc = uint32_t{0};
    bytes.ForEach(offset, length, [&](const uint8_t* data, uint64_t piece, uint64_t position) {
      if (crc.ok()) {
        crc = backend->CopyIn(*source, piece_offset + offset + position, data, piece, *crc);
      }
    });
    if (!crc.ok()) return crc.status();
    if (*crc != stored.chunk_crcs(chunk)) {
      return absl::DataLossError(absl::StrFormat(
          "region '%s' of rank %d, step %d, chunk %d: stored CRC-32C %08x but the bytes received "
          "have %08x", stored.region(), stored.rank(), stored.step(), chunk,
          stored.chunk_crcs(chunk), *crc));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::RestoreResponse> Store::RestoreFromRank(uint32_t rank, uint32_t source_rank,
                                                           const std::vector<std::string>& regions) {
  std::vector<std::shared_ptr<Version>> versions;
  std::optional<int64_t> latest;
  {
    absl::MutexLock lock(&mutex_);
    auto it = ranks_.find(source_rank);
    if (it == ranks_.end() || it->second.committed.empty()) {
      return absl::NotFoundError(absl::StrCat("this node holds no committed step of rank ",
                                              source_rank));
    }
    latest = it->second.latest_committed;
    if (regions.empty()) {
      for (const auto& [name, version] : it->second.committed) versions.push_back(version);
    }
    for (const std::string& name : regions) {
      auto version = it->second.committed.find(name);
      if (version == it->second.committed.end()) {
        return absl::NotFoundError(absl::StrCat("rank ", source_rank, " has no committed region '",
                                                name, "'"));
      }
      versions.push_back(version->second);
    }
  }
  v1::RestoreResponse response;
  response.set_step(latest.value_or(0));
  ReserveRestored(*response.mutable_restored(), static_cast<int>(versions.size()));
  for (const std::shared_ptr<Version>& version : versions) {
    v1::ImageRegion region;
    version->Save(&region);
    if (absl::Status status = WriteRegion(rank, region, *version->stored); !status.ok()) {
      return status;
    }
    AddRestored(*response.mutable_restored(), version->region, version->step, version->bytes,
                region.has_piece() ? &region.piece() : nullptr);
  }
  return response;
}

}  // namespace moesnap::daemon
