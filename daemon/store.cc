// Store: step state machine, chunked captures on the worker pool, journaled commits, restores.
#include "daemon/store.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/byte_size.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/shared_memory.h"
#include "daemon/copy_plan.h"
#include "daemon/progress.h"
#include "daemon/shard_layout.h"
#include "daemon/task_transfers.h"
#include "erasure/crc32c.h"
#include "google/protobuf/arena.h"
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

bool IsFinished(v1::StepState state) {
  return state == v1::STEP_STATE_COMMITTED || state == v1::STEP_STATE_ABORTED;
}

// The open window with only its committed slots: what the journal and a node image record of it.
v1::SparseWindow CommittedSlotsOf(const v1::SparseWindow& window) {
  v1::SparseWindow saved = window;
  saved.clear_slots();
  for (const v1::WindowSlot& slot : window.slots()) {
    if (slot.state() == v1::STEP_STATE_COMMITTED) *saved.add_slots() = slot;
  }
  return saved;
}

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

// `failure` of a task's batch of chunks, naming what the failed run [failed.first, failed.second]
// held: one chunk of a region, or the run of regions it copied. `at(i)` is chunk i's region name
// and chunk index; `what` the operation ("copy", "restore").
template <typename RegionAndChunk>
absl::Status NameFailedRun(const absl::Status& failure, std::pair<size_t, size_t> failed,
                           RegionAndChunk at, absl::string_view what) {
  const auto [region, chunk] = at(failed.first);
  return absl::Status(
      failure.code(),
      failed.first == failed.second
          ? absl::StrCat(what, " of region '", region, "' chunk ", chunk, " failed: ",
                         failure.message())
          : absl::StrCat(what, " of the ", failed.second - failed.first + 1, " regions from '",
                         region, "' to '", at(failed.second).first, "' failed: ",
                         failure.message()));
}

}  // namespace

struct Store::Version {
  uint32_t rank = 0;
  std::string region;
  int64_t step = 0;
  uint64_t bytes = 0;
  std::string dtype;
  // Inline for the usual few dimensions and one chunk: a small region's version allocates neither.
  absl::InlinedVector<int64_t, 4> shape;
  uint64_t chunk_bytes = 0;
  absl::InlinedVector<uint32_t, 1> chunk_crcs;
  std::shared_ptr<PoolBytes> stored;  // its bytes in the pool
  // A member's shard of a replica group: `bytes` bytes of the region from `piece_offset` on.
  std::string replica_group;  // empty: the whole region
  uint64_t piece_offset = 0;
  uint64_t region_bytes = 0;

  bool is_piece() const { return !replica_group.empty(); }
  uint64_t RegionBytes() const { return is_piece() ? region_bytes : bytes; }
  template <typename Saved>
  void SavePiece(Saved* saved) const {
    if (!is_piece()) return;
    v1::RegionPiece* piece = saved->mutable_piece();
    piece->set_replica_group(replica_group);
    piece->set_offset(piece_offset);
    piece->set_region_bytes(region_bytes);
  }
  uint32_t chunks() const { return static_cast<uint32_t>(chunk_crcs.size()); }
  uint64_t ChunkLength(uint32_t chunk) const {
    return std::min(chunk_bytes, bytes - uint64_t{chunk} * chunk_bytes);
  }
};

// A rank's registered regions; immutable once made, so that a step keeps the table it captures
// from without copying it (a registration makes a new table).
struct Store::RegionTable {
  struct Region {
    v1::RegionSpec spec;
    std::shared_ptr<RegionSource> source;
    CopyBackend* backend = nullptr;
  };

  RegionTable() = default;
  // `rank` registered the regions: its member index places its shard in each replica group.
  // `pool_bytes` bounds the plan of a whole-rank step (PlanCopy's space limit).
  RegionTable(std::map<std::string, Region> by_name, uint64_t chunk_bytes, uint32_t rank,
              uint64_t pool_bytes);
  static const std::shared_ptr<const RegionTable>& None();  // a rank with no regions registered

  const std::string& name(uint32_t index) const { return regions[index].spec.name(); }
  std::optional<uint32_t> Find(std::string_view name) const {
    auto it = std::lower_bound(regions.begin(), regions.end(), name,
                               [](const Region& region, std::string_view key) {
                                 return region.spec.name() < key;
                               });
    if (it == regions.end() || it->spec.name() != name) return std::nullopt;
    return static_cast<uint32_t>(it - regions.begin());
  }

  std::vector<Region> regions;  // by name
  // Per index, what the rank captures of it: the whole region, or its shard of the region's
  // replica group (possibly nothing).
  std::vector<ShardPiece> pieces;
  std::map<std::string, v1::ReplicaGroup> groups;  // the regions' replica groups, by name
  std::vector<uint32_t> all;    // every index with a piece: what a whole-rank step captures
  std::shared_ptr<const CopyPlan> plan_of_all;
};

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
  plan_of_all = std::make_shared<const CopyPlan>(PlanCopy(
      all.size(), [this](uint32_t position) { return pieces[all[position]].bytes; },
      [chunk_bytes](uint32_t) { return chunk_bytes; }, chunk_bytes, pool_bytes));
}

// A copy into or out of a rank's trainer memory, counted while it lives (queued or running): the
// memory of a trainer that exited is handed on only when none is left (CopyingTrainerMemory).
class Store::CopyInFlight {
 public:
  explicit CopyInFlight(std::shared_ptr<std::atomic<uint32_t>> count) : count_(std::move(count)) {
    count_->fetch_add(1);
  }
  ~CopyInFlight() { count_->fetch_sub(1); }
  CopyInFlight(const CopyInFlight&) = delete;
  CopyInFlight& operator=(const CopyInFlight&) = delete;

 private:
  const std::shared_ptr<std::atomic<uint32_t>> count_;
};

// One step's capture while its parts copy: what they share.
struct Store::CaptureJob {
  uint32_t rank = 0;
  int64_t step = 0;
  std::shared_ptr<const RegionTable> table;
  // Released by the last part to finish copying, before the step is marked captured.
  std::unique_ptr<const CopyInFlight> in_flight;
  std::atomic<size_t> parts_copying = 0;
  std::shared_ptr<const std::vector<uint32_t>> selection;
  std::shared_ptr<const CopyPlan> plan;
  std::shared_ptr<const PoolReservation> reservation;
  std::vector<std::shared_ptr<Version>> versions;  // per position, made by the part that copies it
  absl::Mutex mutex;
  absl::Status failure ABSL_GUARDED_BY(mutex);  // the first copy that failed
};

struct Store::StepRecord {
  int64_t step = 0;
  v1::StepState state = v1::STEP_STATE_CAPTURING;
  std::vector<std::shared_ptr<Version>> versions;  // once captured; released once the step finishes
  // What the step captures (regions of `table` at the indices of `selection`), kept after it ends.
  std::shared_ptr<const RegionTable> table;
  std::shared_ptr<const std::vector<uint32_t>> selection;
  std::optional<v1::SparseSlot> sparse;             // its place in a window, for a sparse step
  bool whole = false;  // captures every piece the rank registered (`table->all`)
  const CaptureJob* capture = nullptr;  // the copy in progress, while capturing
  uint64_t pending_parts = 0;
  bool captured = false;  // every chunk was copied (it may have aborted later, in the cluster)
  bool skipped = false;   // never captured: the daemon skipped it (Snapshot says why)
  bool discarded = false;  // of a timeline a restore ended: the rank takes the step again
  bool offered = false;    // returned by WaitNewNodeCapture since it was captured
  uint64_t bytes = 0;
  uint32_t regions = 0;
  absl::Status failure;
  absl::Time started;        // Snapshot accepted it
  absl::Time captured_time;  // every chunk copied

  bool Captures(const std::string& region) const {
    const std::optional<uint32_t> index = table->Find(region);
    return index && std::binary_search(selection->begin(), selection->end(), *index);
  }
};

struct Store::RankState {
  uint64_t session = 0;  // the trainer process registered now (TrainerSessions' number)
  std::shared_ptr<const RegionTable> regions = RegionTable::None();
  std::map<std::string, std::shared_ptr<Version>> committed;
  std::map<int64_t, StepRecord> steps;
  std::optional<int64_t> latest_committed;
  std::optional<int64_t> latest_snapshot;
  // Sparse windows: the last one all of whose slots committed, and the one after it.
  std::optional<v1::SparseWindow> committed_window;
  std::optional<v1::SparseWindow> open_window;
  // A new process of a rank with committed state connected and has not registered its regions
  // yet: in a cluster, steps wait for it (it snapshots the steps it replays) instead of
  // committing without it.
  bool restarting = false;
  // The latest snapshot when the rank's current process connected: it may replay steps up to here.
  std::optional<int64_t> replay_through;
  // The replica groups of the committed state, by name: who held which shard at which step.
  std::map<std::string, v1::ReplicaGroupStep> replica_groups;
  std::optional<v1::RankCapture> last_capture;  // what its last captured step copied
  // Copies of its trainer memory queued or running (CopyInFlight), of any of its sessions.
  std::shared_ptr<std::atomic<uint32_t>> copies = std::make_shared<std::atomic<uint32_t>>(0);

  const StepRecord* Capturing() const {
    for (const auto& [step, record] : steps) {
      if (record.state == v1::STEP_STATE_CAPTURING) return &record;
    }
    return nullptr;
  }
};

// A committed version from its record: a journal entry (v1::JournalVersion) or an image region
// (v1::ImageRegion), which carry the same fields.
template <typename Saved>
std::shared_ptr<Store::Version> Store::VersionFrom(const Saved& saved,
                                                   std::shared_ptr<PoolBytes> stored) {
  auto version = std::make_shared<Version>();
  version->rank = saved.rank();
  version->region = saved.region();
  version->step = saved.step();
  version->bytes = saved.bytes();
  version->dtype = saved.dtype();
  version->shape.assign(saved.shape().begin(), saved.shape().end());
  version->chunk_bytes = saved.chunk_bytes();
  version->chunk_crcs.assign(saved.chunk_crcs().begin(), saved.chunk_crcs().end());
  version->stored = std::move(stored);
  if (saved.has_piece()) {
    version->replica_group = saved.piece().replica_group();
    version->piece_offset = saved.piece().offset();
    version->region_bytes = saved.piece().region_bytes();
  }
  return version;
}

void Store::AddToImage(const Version& version, v1::NodeImage* manifest) {
  v1::ImageRegion* region = manifest->add_regions();
  region->set_rank(version.rank);
  region->set_region(version.region);
  region->set_step(version.step);
  region->set_bytes(version.bytes);
  region->set_dtype(version.dtype);
  for (int64_t dimension : version.shape) region->add_shape(dimension);
  region->set_chunk_bytes(version.chunk_bytes);
  for (uint32_t crc : version.chunk_crcs) region->add_chunk_crcs(crc);
  version.SavePiece(region);
}

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
    return journal_->Write(v1::JournalState());
  }
  for (const v1::JournalVersion& saved : state.versions()) {
    std::vector<ExtentAllocator::Range> extents;
    for (const v1::PoolSpan& span : saved.extents()) extents.push_back({span.offset(), span.bytes()});
    if (extents.empty()) {  // written by an earlier daemon: one extent
      std::optional<uint64_t> rounded = ExtentAllocator::RoundUp(saved.bytes(), pool_->capacity());
      extents.push_back({saved.pool_offset(), rounded.value_or(0)});
    }
    absl::StatusOr<std::shared_ptr<PoolBytes>> stored = pool_->ClaimBytes(extents, saved.bytes());
    if (!stored.ok()) {
      return absl::DataLossError(absl::StrCat("journal entry for region '", saved.region(),
                                              "' of rank ", saved.rank(), " at step ", saved.step(),
                                              ": ", stored.status().message()));
    }
    ranks_[saved.rank()].committed[saved.region()] = VersionFrom(saved, *std::move(stored));
  }
  for (const v1::JournalRank& saved : state.ranks()) {
    RankState& rank_state = ranks_[saved.rank()];
    LoadRankRecord(saved, &rank_state);
  }
  cluster_ = state.cluster();
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

void Store::StartSession(uint32_t rank, uint64_t session) {
  activity_.Active(rank);
  absl::MutexLock lock(&mutex_);
  RankState& rank_state = ranks_[rank];
  rank_state.session = session;
  rank_state.regions = RegionTable::None();  // copies in flight keep their own references to the old table
  rank_state.restarting = rank_state.latest_committed.has_value();
  rank_state.replay_through = rank_state.latest_snapshot;
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
  step_changed_.SignalAll();
}

absl::Status Store::RegisterRegions(uint32_t rank, const std::vector<v1::RegionSpec>& regions) {
  // The regions are the memory of the rank's process now: should a newer process start before they
  // are in, they are not its (its memory may even be what this process left, handed on).
  uint64_t session = 0;
  {
    absl::MutexLock lock(&mutex_);
    session = ranks_[rank].session;
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
      current = ranks_[rank].regions;
    }
    std::map<std::string, RegionTable::Region> merged = opened;
    for (const RegionTable::Region& region : current->regions) merged.emplace(region.spec.name(), region);
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
    RankState& rank_state = ranks_[rank];
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

absl::StatusOr<v1::SnapshotResponse> Store::Snapshot(uint32_t rank, int64_t step,
                                                     const std::vector<std::string>& regions,
                                                     const std::optional<v1::SparseSlot>& sparse) {
  activity_.Active(rank);
  absl::MutexLock lock(&mutex_);
  RankState& rank_state = ranks_[rank];
  const std::shared_ptr<const RegionTable> table = rank_state.regions;
  if (table->regions.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " has no registered regions to snapshot"));
  }
  if (const StepRecord* capturing = rank_state.Capturing()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", capturing->step, " of rank ", rank, " is still capturing: call WaitCaptured(",
        capturing->step, ") before the next Snapshot"));
  }
  if (rank_state.latest_snapshot && step <= *rank_state.latest_snapshot) {
    // A new process of the rank replaying a step its predecessor captured (or committed) already:
    // deterministic training gives the same bytes, so the capture stands.
    if (auto it = rank_state.steps.find(step);
        rank_state.replay_through && step <= *rank_state.replay_through &&
        it != rank_state.steps.end() && it->second.state != v1::STEP_STATE_ABORTED &&
        (!sparse || (it->second.sparse && it->second.sparse->buffer() == sparse->buffer()))) {
      return v1::SnapshotResponse();  // nothing to copy
    }
    return absl::InvalidArgumentError(absl::StrCat("step ", step, " of rank ", rank,
                                                   " is not after step ",
                                                   *rank_state.latest_snapshot,
                                                   ", its latest snapshot"));
  }

  // What the step captures: every region (the table's own selection and plan, made once at
  // registration, so that a step of thousands of regions costs no work per region here), or the
  // regions named. A dense step that names some regions also takes every region an earlier step
  // of the rank's timeline captured and did not commit (skipped, aborted, or still waiting): the
  // trainer's memory holds their values as of this step, and without them the step would not be a
  // consistent state. A step of a timeline a whole restore ended changed nothing that restore left.
  std::shared_ptr<const std::vector<uint32_t>> selection(table, &table->all);
  std::shared_ptr<const CopyPlan> plan = table->plan_of_all;
  if (!regions.empty()) {
    std::vector<uint32_t> chosen;
    for (const std::string& name : regions) {
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
    if (chosen.size() < table->all.size()) {
      auto named = std::make_shared<const std::vector<uint32_t>>(std::move(chosen));
      plan = std::make_shared<const CopyPlan>(PlanCopy(
          named->size(), [&](uint32_t position) { return table->pieces[(*named)[position]].bytes; },
          [this](uint32_t) { return options_.chunk_bytes; }, options_.chunk_bytes,
          pool_->capacity()));
      selection = std::move(named);
    }
  }

  if (sparse && !table->groups.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " holds regions of replica group '", table->groups.begin()->first,
        "': sparse snapshots of replica groups are not supported; snapshot them densely"));
  }
  if (sparse) {
    const std::optional<v1::SparseWindow>& open = rank_state.open_window;
    if (sparse->slot() > 0 && open && open->first_step() == sparse->window_first_step() &&
        !open->failure().empty()) {
      return Skip(rank_state, rank, step, sparse, table, selection,
                  absl::StrCat("the window from step ", open->first_step(),
                               " can no longer commit: ", open->failure()));
    }
    if (absl::Status status = CheckSparseSlot(rank_state, rank, step, *sparse); !status.ok()) {
      return status;
    }
  } else {
    std::vector<int64_t> waiting;
    for (const auto& [earlier, record] : rank_state.steps) {
      if (!record.sparse && !IsFinished(record.state)) waiting.push_back(earlier);
    }
    if (options_.max_in_flight_steps > 0 &&
        waiting.size() >= static_cast<size_t>(options_.max_in_flight_steps)) {
      return Skip(rank_state, rank, step, sparse, table, selection,
                  absl::StrCat("steps ", absl::StrJoin(waiting, ", "),
                               " still wait for their commit (capture.max_in_flight_steps = ",
                               options_.max_in_flight_steps, "): commits lag behind training"));
    }
  }

  // A member whose shard is empty (more members than alignment units) copies nothing. A plan past
  // the whole pool has no parts either (PlanCopy), and the pool refuses it below.
  const bool fits_pool = plan->space <= pool_->capacity();
  const bool copies_nothing = plan->parts.empty() && fits_pool;
  if (const uint64_t kept = ParityReserveLocked();
      kept > 0 && !plan->parts.empty() && fits_pool &&
      pool_->free_bytes() < SaturatingAdd(plan->space, kept)) {
    return Skip(rank_state, rank, step, sparse, table, selection,
                absl::StrCat("it needs ", plan->bytes, " bytes (", FormatByteSize(plan->bytes),
                             ") and the pool keeps ", FormatByteSize(kept), " for the parity of "
                             "steps being encoded; ", FormatByteSize(pool_->free_bytes()),
                             " are free: commits lag behind training"));
  }
  // The pool space of the whole step in one reservation; the copy threads cut it into versions.
  absl::StatusOr<std::shared_ptr<const PoolReservation>> reservation =
      copies_nothing ? std::shared_ptr<const PoolReservation>() : pool_->Reserve(plan->space);
  if (!reservation.ok()) {
    return Skip(rank_state, rank, step, sparse, table, selection,
                absl::StrCat("it needs ", plan->bytes, " bytes (", FormatByteSize(plan->bytes),
                             ") for ", selection->size(), " regions: ",
                             reservation.status().message(),
                             fits_pool ? ""
                                       : "; that is more than the whole pool: no step of these "
                                         "regions fits until pool.bytes is larger"));
  }
  auto job = std::make_shared<CaptureJob>();
  job->rank = rank;
  job->step = step;
  job->table = table;
  job->in_flight = std::make_unique<const CopyInFlight>(rank_state.copies);
  job->parts_copying = plan->parts.size();
  job->selection = selection;
  job->plan = plan;
  job->reservation = *std::move(reservation);
  job->versions.resize(selection->size());
  for (uint32_t position : plan->large) {  // copied by several parts: made before any of them runs
    job->versions[position] = NewVersion(*job, position);
  }

  StepRecord record;
  record.step = step;
  record.started = absl::Now();
  record.bytes = plan->bytes;
  record.regions = static_cast<uint32_t>(selection->size());
  record.table = table;
  record.selection = selection;
  record.sparse = sparse;
  record.whole = selection.get() == &table->all;
  record.capture = job.get();
  record.pending_parts = plan->parts.size();
  if (sparse) AddWindowSlot(rank_state, step, *sparse, v1::STEP_STATE_CAPTURING);
  in_flight_bytes_ += record.bytes;
  rank_state.latest_snapshot = step;
  Log(LogLevel::kDebug, "rank ", rank, " step ", step, ": capturing ", record.regions,
      " regions, ", record.bytes, " bytes in ", plan->parts.size(), " parts");
  v1::SnapshotResponse response;
  response.set_bytes(record.bytes);
  StepRecord& started = rank_state.steps[step] = std::move(record);
  if (plan->parts.empty()) {
    FinishStep(rank_state, rank, started);
    return response;
  }
  std::vector<std::function<void()>> parts;
  parts.reserve(plan->parts.size());
  for (size_t part = 0; part < plan->parts.size(); ++part) {
    parts.push_back([this, job, part] { CapturePart(job, part); });
  }
  workers_.SubmitAll(std::move(parts));
  return response;
}

std::shared_ptr<Store::Version> Store::NewVersion(const CaptureJob& job, uint32_t position) const {
  const uint32_t index = (*job.selection)[position];
  const v1::RegionSpec& spec = job.table->regions[index].spec;
  const ShardPiece& piece = job.table->pieces[index];
  auto version = std::make_shared<Version>();
  version->rank = job.rank;
  version->region = spec.name();
  version->step = job.step;
  version->bytes = piece.bytes;
  version->dtype = spec.dtype();
  version->shape.assign(spec.shape().begin(), spec.shape().end());
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

void Store::AddWindowSlot(RankState& rank_state, int64_t step, const v1::SparseSlot& sparse,
                          v1::StepState state) {
  if (sparse.slot() == 0) {  // a new window; an open one left incomplete is abandoned
    rank_state.open_window.emplace();
    rank_state.open_window->set_first_step(sparse.window_first_step());
    rank_state.open_window->set_size(sparse.window_size());
    rank_state.open_window->set_buffer(sparse.buffer());
  }
  v1::WindowSlot* slot = rank_state.open_window->add_slots();
  slot->set_slot(sparse.slot());
  slot->set_step(step);
  slot->set_state(state);
  *slot->mutable_operators() = sparse.operators();
}

uint64_t Store::ParityReserveLocked() {
  if (options_.parity_share <= 0) return 0;
  uint64_t committed = 0;  // the largest image of the group's committed step
  for (const v1::NodeImage& image : cluster_.group_images()) {
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

v1::SnapshotResponse Store::Skip(RankState& rank_state, uint32_t rank, int64_t step,
                                const std::optional<v1::SparseSlot>& sparse,
                                std::shared_ptr<const RegionTable> table,
                                std::shared_ptr<const std::vector<uint32_t>> selection,
                                const std::string& why) {
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
  if (sparse) {
    AddWindowSlot(rank_state, step, *sparse, v1::STEP_STATE_ABORTED);
    if (rank_state.open_window->failure().empty()) {
      rank_state.open_window->set_failure(
          absl::StrCat("slot ", sparse->slot(), " (step ", step, ") was skipped: ", why));
    }
  }
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
  TaskTransfers transfers;
  auto add = [&](uint32_t position, uint32_t chunk) {
    const RegionTable::Region& region = job->table->regions[(*job->selection)[position]];
    const Version& version = *job->versions[position];
    const uint64_t offset = uint64_t{chunk} * version.chunk_bytes;
    transfers.AddChunk(region.backend, region.source.get(), version.piece_offset + offset,
                       *version.stored, offset, version.ChunkLength(chunk));
    chunks.emplace_back(position, chunk);
  };
  if (part.chunk) {
    add(part.first, *part.chunk);
  } else {
    for (uint32_t position = part.first; position < part.last; ++position) {
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
  RankState& rank_state = ranks_[job->rank];
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
    record.versions = std::move(job->versions);
    FinishStep(rank_state, job->rank, record);
  }
}

absl::Status Store::WriteJournal(const std::map<uint32_t, const StepRecord*>& committing,
                                 const v1::JournalCluster& cluster) const {
  google::protobuf::Arena arena;
  auto* state = google::protobuf::Arena::CreateMessage<v1::JournalState>(&arena);
  auto add = [state](const Version& version) {
    v1::JournalVersion* saved = state->add_versions();
    saved->set_rank(version.rank);
    saved->set_region(version.region);
    saved->set_step(version.step);
    for (const std::shared_ptr<PoolExtent>& extent : version.stored->extents()) {
      v1::PoolSpan* span = saved->add_extents();
      span->set_offset(extent->offset());
      span->set_bytes(extent->bytes());
    }
    saved->set_bytes(version.bytes);
    saved->set_dtype(version.dtype);
    saved->mutable_shape()->Add(version.shape.begin(), version.shape.end());
    saved->set_chunk_bytes(version.chunk_bytes);
    saved->mutable_chunk_crcs()->Add(version.chunk_crcs.begin(), version.chunk_crcs.end());
    version.SavePiece(saved);
  };
  for (const auto& [rank_id, rank_state] : ranks_) {
    const StepRecord* record = nullptr;
    if (auto it = committing.find(rank_id); it != committing.end()) record = it->second;
    ForEachVersionAfter(rank_state, record, add);
    if (std::optional<v1::JournalRank> saved = RankRecordAfter(rank_id, rank_state, record)) {
      *state->add_ranks() = *std::move(saved);
    }
  }
  *state->mutable_cluster() = cluster;
  return journal_->Write(*state);
}

void Store::FinishStep(RankState& rank_state, uint32_t rank, StepRecord& record) {
  record.state = v1::STEP_STATE_CAPTURED;
  record.captured_time = absl::Now();
  StepMetrics::Get().capture_seconds.Observe(absl::ToDoubleSeconds(record.captured_time - record.started));
  MarkSlot(record, record.state, &rank_state.open_window);
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
  if (absl::Status status = WriteJournal(committing, cluster_); !status.ok()) {
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
  CommitReplicaGroups(record, &rank_state.committed, &rank_state.replica_groups);
  record.state = v1::STEP_STATE_COMMITTED;
  if (record.captured_time != absl::Time()) {  // captured by this process, not recovered
    StepMetrics::Get().commit_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - record.captured_time));
  }
  StepMetrics::Get().committed.Add();
  rank_state.latest_committed = record.step;
  AdvanceWindows(record, &rank_state.open_window, &rank_state.committed_window);
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
  if (MarkSlot(record, record.state, &rank_state.open_window)) {
    rank_state.open_window->set_failure(absl::StrCat("slot ", record.sparse->slot(), " (step ",
                                                     record.step, ") aborted: ",
                                                     record.failure.message()));
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

}  // namespace moesnap::daemon

namespace moesnap::daemon {

absl::StatusOr<v1::RestoreResponse> Store::Restore(uint32_t rank, std::optional<int64_t> step,
                                                   const std::vector<std::string>& regions,
                                                   absl::Time deadline,
                                                   std::vector<GroupRegion>* remote) {
  struct Work {
    std::shared_ptr<Version> version;
    const RegionTable::Region* region;  // in `table`
  };
  std::shared_ptr<const RegionTable> table;
  std::optional<CopyInFlight> in_flight;  // until every part has copied (the wait below)
  auto work = std::make_shared<std::vector<Work>>();
  v1::RestoreResponse response;
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
    auto check = [&](const v1::RegionSpec& spec, const Version& version) -> absl::Status {
      const std::string& name = spec.name();
      if (spec.bytes() != version.RegionBytes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "region '", name, "' is ", spec.bytes(), " bytes in this trainer, but step ",
            version.step, " stored ", version.RegionBytes()));
      }
      if (!spec.dtype().empty() && !version.dtype.empty() && spec.dtype() != version.dtype) {
        return absl::InvalidArgumentError(absl::StrCat("region '", name, "' is ", spec.dtype(),
                                                       " in this trainer, but step ", version.step,
                                                       " stored ", version.dtype));
      }
      if (spec.shape_size() > 0 && !version.shape.empty() &&
          !std::equal(spec.shape().begin(), spec.shape().end(), version.shape.begin(),
                      version.shape.end())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "region '", name, "' has shape [", absl::StrJoin(spec.shape(), ", "),
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
    auto add = [&](const RegionTable::Region& registered, const std::shared_ptr<Version>* stored)
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) -> absl::Status {
      const v1::RegionSpec& spec = registered.spec;
      v1::RestoreResponse::Restored* restored = response.add_regions();
      restored->set_region(spec.name());
      restored->set_bytes(spec.bytes());
      if (stored != nullptr && !(*stored)->is_piece()) {
        if (absl::Status status = check(spec, **stored); !status.ok()) return status;
        work->push_back({*stored, &registered});
        restored->set_step((*stored)->step);
        return absl::OkStatus();
      }
      const v1::ReplicaGroupStep* layout =
          LayoutOf(rank_state, spec, stored != nullptr ? stored->get() : nullptr);
      if (layout == nullptr) return not_committed(spec.name());
      absl::StatusOr<HeldPieces> held = GroupPieces(*layout, spec.name(), remote != nullptr);
      if (!held.ok()) return held.status();
      for (const std::shared_ptr<Version>& piece : held->versions) {
        if (absl::Status status = check(spec, *piece); !status.ok()) return status;
        work->push_back({piece, &registered});
      }
      if (!held->versions.empty()) restored->set_step(held->versions.front()->step);
      if (!held->remote_members.empty()) {
        remote->push_back({spec.name(), *layout, std::move(held->pieces),
                           std::move(held->remote_members)});
      }
      return absl::OkStatus();
    };
    if (regions.empty()) {
      // Both are in name order: one pass over each.
      auto stored = rank_state.committed.begin();
      for (const RegionTable::Region& registered : table->regions) {
        const std::string& name = registered.spec.name();
        while (stored != rank_state.committed.end() && stored->first < name) ++stored;
        const bool found = stored != rank_state.committed.end() && stored->first == name;
        if (absl::Status status = add(registered, found ? &stored->second : nullptr); !status.ok()) {
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
        if (absl::Status status = add(table->regions[*index], found ? &stored->second : nullptr);
            !status.ok()) {
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
      rank_state.replay_through.reset();
    }
  }

  // Copy outside the lock on the capture threads, a run of small regions or a chunk of a large one
  // per task; the versions held here cannot be freed by a concurrent commit. The first failure is
  // reported; the other parts still finish.
  const auto plan = std::make_shared<const CopyPlan>(PlanCopy(
      work->size(), [&](uint32_t position) { return (*work)[position].version->bytes; },
      [&](uint32_t position) { return (*work)[position].version->chunk_bytes; },
      options_.chunk_bytes));
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
      TaskTransfers transfers;
      auto add = [&](const Work& item, uint32_t chunk) {
        const Version& version = *item.version;
        const uint64_t offset = uint64_t{chunk} * version.chunk_bytes;
        transfers.AddChunk(item.region->backend, item.region->source.get(),
                           version.piece_offset + offset, *version.stored, offset,
                           version.ChunkLength(chunk));
        chunks.emplace_back(&version, chunk);
      };
      if (range.chunk) {
        add((*work)[range.first], *range.chunk);
      } else {
        for (uint32_t position = range.first; position < range.last; ++position) {
          add((*work)[position], 0);
        }
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
    if (!progress->status.ok()) return progress->status;
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

v1::RankWindows Store::WindowsOf(uint32_t rank, const RankState& rank_state) {
  v1::RankWindows windows;
  windows.set_rank(rank);
  if (rank_state.committed_window) *windows.mutable_committed_window() = *rank_state.committed_window;
  if (rank_state.open_window) *windows.mutable_open_window() = *rank_state.open_window;
  return windows;
}

v1::RankWindows Store::Windows(uint32_t rank) const {
  absl::MutexLock lock(&mutex_);
  auto it = ranks_.find(rank);
  if (it == ranks_.end()) return WindowsOf(rank, RankState());
  return WindowsOf(rank, it->second);
}

v1::ListWindowsResponse Store::ListWindows(std::optional<uint32_t> rank) const {
  v1::ListWindowsResponse response;
  absl::MutexLock lock(&mutex_);
  for (const auto& [rank_id, rank_state] : ranks_) {
    if ((!rank || *rank == rank_id) && (rank_state.committed_window || rank_state.open_window)) {
      *response.add_ranks() = WindowsOf(rank_id, rank_state);
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
    if (rank_state.committed_window) {
      rank_point = rank_state.committed_window->first_step();
    } else if (rank_state.open_window) {
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

absl::Status Store::CheckSparseSlot(const RankState& rank_state, uint32_t rank, int64_t step,
                                    const v1::SparseSlot& sparse) {
  const auto where = [&] {
    return absl::StrCat("step ", step, " of rank ", rank, " as slot ", sparse.slot(),
                        " of the window from step ", sparse.window_first_step());
  };
  const std::optional<v1::SparseWindow>& open = rank_state.open_window;
  if (sparse.slot() == 0) {
    const std::optional<v1::SparseWindow>& committed = rank_state.committed_window;
    if (committed && committed->buffer() == sparse.buffer()) {
      return absl::FailedPreconditionError(absl::StrCat(
          where(), ": buffer ", sparse.buffer(), " holds the last committed window (from step ",
          committed->first_step(), "), kept until the next window commits; write the other one"));
    }
    if (!open) return absl::OkStatus();
    for (const v1::WindowSlot& slot : open->slots()) {
      if (slot.state() == v1::STEP_STATE_CAPTURING || slot.state() == v1::STEP_STATE_CAPTURED) {
        return absl::FailedPreconditionError(absl::StrCat(
            where(), ": slot ", slot.slot(), " (step ", slot.step(), ") of the open window from step ",
            open->first_step(), " is not committed yet; WaitCommitted(", slot.step(), ") first"));
      }
    }
    return absl::OkStatus();
  }
  if (!open || open->first_step() != sparse.window_first_step() ||
      open->size() != sparse.window_size() || open->buffer() != sparse.buffer()) {
    return absl::FailedPreconditionError(absl::StrCat(
        where(), " (", sparse.window_size(), " steps, buffer ", sparse.buffer(), "): the rank's open "
        "window is ",
        open ? absl::StrCat("the one from step ", open->first_step(), " (", open->size(),
                            " steps, buffer ", open->buffer(), ")")
             : "none",
        "; a window starts with its slot 0"));
  }
  const int64_t expected = open->slots().empty() ? 0 : open->slots().rbegin()->slot() + 1;
  if (sparse.slot() != expected) {
    return absl::FailedPreconditionError(absl::StrCat(where(), ": the window's next slot is ",
                                                      expected));
  }
  return absl::OkStatus();
}

bool Store::MarkSlot(const StepRecord& record, v1::StepState state,
                     std::optional<v1::SparseWindow>* open) {
  if (!record.sparse || !*open || (*open)->first_step() != record.sparse->window_first_step()) {
    return false;
  }
  for (v1::WindowSlot& slot : *(*open)->mutable_slots()) {
    if (slot.step() == record.step) slot.set_state(state);
  }
  return true;
}

void Store::AdvanceWindows(const StepRecord& record, std::optional<v1::SparseWindow>* open,
                           std::optional<v1::SparseWindow>* committed) {
  if (!MarkSlot(record, v1::STEP_STATE_COMMITTED, open)) return;
  const auto committed_slots = static_cast<uint32_t>(
      std::count_if((*open)->slots().begin(), (*open)->slots().end(),
                    [](const v1::WindowSlot& slot) { return slot.state() == v1::STEP_STATE_COMMITTED; }));
  if (committed_slots == (*open)->size()) {
    *committed = std::move(*open);
    open->reset();
  }
}

std::optional<v1::JournalRank> Store::RankRecordAfter(uint32_t rank, const RankState& rank_state,
                                                      const StepRecord* committing) {
  std::optional<int64_t> latest = rank_state.latest_committed;
  std::optional<v1::SparseWindow> open = rank_state.open_window;
  std::optional<v1::SparseWindow> committed = rank_state.committed_window;
  std::map<std::string, v1::ReplicaGroupStep> groups = rank_state.replica_groups;
  if (committing != nullptr) {
    latest = committing->step;
    AdvanceWindows(*committing, &open, &committed);
    CommitReplicaGroups(*committing, nullptr, &groups);
  }
  if (!latest) return std::nullopt;
  v1::JournalRank saved;
  saved.set_rank(rank);
  saved.set_latest_committed_step(*latest);
  if (committed) *saved.mutable_committed_window() = *committed;
  if (open) *saved.mutable_open_window() = CommittedSlotsOf(*open);
  for (const auto& [name, group] : groups) *saved.add_replica_groups() = group;
  return saved;
}

template <typename Visit>
void Store::ForEachVersionAfter(const RankState& rank_state, const StepRecord* committing,
                                Visit visit) {
  // The committing step's versions, in name order (those of sparse aliases may not come in it).
  std::vector<const Version*> newer;
  if (committing != nullptr) {
    newer.reserve(committing->versions.size());
    for (const std::shared_ptr<Version>& version : committing->versions) {
      newer.push_back(version.get());
    }
    auto by_name = [](const Version* a, const Version* b) { return a->region < b->region; };
    if (!std::is_sorted(newer.begin(), newer.end(), by_name)) {
      std::sort(newer.begin(), newer.end(), by_name);
    }
  }
  // A whole step drops the pieces earlier steps left (as CommitReplicaGroups does).
  auto left_behind = [committing](const Version& version) {
    return committing != nullptr && committing->whole && version.is_piece() &&
           version.step < committing->step;
  };
  auto older = rank_state.committed.begin();
  const auto older_end = rank_state.committed.end();
  size_t next = 0;
  while (older != older_end || next < newer.size()) {
    const Version* version;
    if (next < newer.size() && (older == older_end || newer[next]->region <= older->first)) {
      if (older != older_end && older->first == newer[next]->region) ++older;  // replaced by it
      version = newer[next++];
    } else {
      version = (older++)->second.get();
    }
    if (!left_behind(*version)) visit(*version);
  }
}

void Store::CommitReplicaGroups(const StepRecord& record,
                                std::map<std::string, std::shared_ptr<Version>>* committed,
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
  if (saved.has_committed_window()) rank_state->committed_window = saved.committed_window();
  if (saved.has_open_window()) rank_state->open_window = saved.open_window();
  rank_state->replica_groups.clear();
  for (const v1::ReplicaGroupStep& layout : saved.replica_groups()) {
    rank_state->replica_groups[layout.group().name()] = layout;
  }
}

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
  std::map<uint32_t, std::map<std::string, std::shared_ptr<Version>>> removed;
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
  if (absl::Status status = WriteJournal({}, cluster_); !status.ok()) {
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

// --- Cluster mode ---------------------------------------------------------------------------------

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

absl::StatusOr<bool> Store::NodeCaptured(int64_t step) const {
  absl::StatusOr<std::vector<uint32_t>> waiting = RanksStillCapturing(step);
  if (!waiting.ok()) return waiting.status();
  const bool any_trainer = std::any_of(ranks_.begin(), ranks_.end(),
                                       [](const auto& rank) { return !rank.second.regions->regions.empty(); });
  return waiting->empty() && (any_trainer || options_.parity_only);
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
    if (WaitStepChanged(deadline)) {
      return absl::DeadlineExceededError("no new capture of a step on this node");
    }
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

bool Store::WaitStepChanged(absl::Time deadline) {
  const absl::Time idle_at = activity_.NextIdleAt().value_or(absl::InfiniteFuture());
  step_changed_.WaitWithDeadline(&mutex_, std::min(deadline, idle_at));
  return absl::Now() >= deadline;
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
    if (WaitStepChanged(deadline)) {
      const std::vector<uint32_t> waiting = RanksStillCapturing(step).value_or(std::vector<uint32_t>());
      return absl::DeadlineExceededError(absl::StrCat(
          "step ", step, " is not captured on this node: ranks [", absl::StrJoin(waiting, ", "),
          "] have not snapshotted it", waiting.empty() ? " (no trainer is registered)" : ""));
    }
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
        const std::string& region = record.table->name(index);
        if (captured.Captures(region)) continue;
        auto committed = rank_state.committed.find(region);
        if (committed == rank_state.committed.end() || committed->second->step < earlier) {
          return absl::FailedPreconditionError(absl::StrCat(
              "step ", step, " of rank ", rank, " leaves out region '", region,
              "', which step ", earlier, " changed and did not commit; the rank's next full "
              "snapshot is the next consistent step"));
        }
      }
    }
  }
  v1::NodeImage manifest;
  manifest.set_step(step);
  std::vector<std::shared_ptr<PoolBytes>> stored;
  for (const auto& [rank, rank_state] : ranks_) {
    const StepRecord* record = nullptr;
    if (auto it = rank_state.steps.find(step); it != rank_state.steps.end()) record = &it->second;
    ForEachVersionAfter(rank_state, record, [&](const Version& version) {
      AddToImage(version, &manifest);
      stored.push_back(version.stored);
    });
    if (std::optional<v1::JournalRank> saved = RankRecordAfter(rank, rank_state, record)) {
      *manifest.add_ranks() = *std::move(saved);
    }
  }
  prepared_steps_.insert(step);
  return NodeImage(std::move(manifest), std::move(stored));
}

NodeImage Store::CommittedImage() const {
  absl::MutexLock lock(&mutex_);
  return CommittedImageLocked();
}

NodeImage Store::CommittedImageLocked() const {
  v1::NodeImage manifest;
  if (cluster_.has_committed_step()) manifest.set_step(cluster_.committed_step());
  std::vector<std::shared_ptr<PoolBytes>> stored;
  for (const auto& [rank, rank_state] : ranks_) {
    for (const auto& [name, version] : rank_state.committed) {
      AddToImage(*version, &manifest);
      stored.push_back(version->stored);
    }
    if (std::optional<v1::JournalRank> saved = RankRecordAfter(rank, rank_state, nullptr)) {
      *manifest.add_ranks() = *std::move(saved);
    }
  }
  return NodeImage(std::move(manifest), std::move(stored));
}

std::optional<int64_t> Store::NodeCommittedStep() const {
  if (mode_ == CommitMode::kCluster) {
    return cluster_.has_committed_step() ? std::optional<int64_t>(cluster_.committed_step())
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
  std::map<std::string, std::shared_ptr<Version>> adopted;
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
  RankState previous;
  previous.committed = std::move(rank_state.committed);
  previous.latest_committed = rank_state.latest_committed;
  previous.committed_window = std::move(rank_state.committed_window);
  previous.open_window = std::move(rank_state.open_window);
  rank_state.committed = std::move(adopted);
  rank_state.committed_window.reset();
  rank_state.open_window.reset();
  LoadRankRecord(record, &rank_state);
  // In a cluster the group's parity covers the committed step this node had, not the loaded one:
  // the record goes, so that the next step is encoded whole.
  const v1::JournalCluster kept = mode_ == CommitMode::kCluster ? v1::JournalCluster() : cluster_;
  if (absl::Status status = WriteJournal({}, kept); !status.ok()) {
    rank_state.committed = std::move(previous.committed);
    rank_state.latest_committed = previous.latest_committed;
    rank_state.latest_snapshot = previous.latest_committed;
    rank_state.committed_window = std::move(previous.committed_window);
    rank_state.open_window = std::move(previous.open_window);
    return status;
  }
  cluster_ = kept;
  notified_step_ = NodeCommittedStep();  // loaded, not committed anew: nothing to drain
  step_changed_.SignalAll();
  return absl::OkStatus();
}


absl::Status Store::CommitNodeStep(int64_t step, const v1::JournalCluster& cluster) {
  absl::MutexLock lock(&mutex_);
  std::map<uint32_t, const StepRecord*> committing;
  for (auto& [rank, rank_state] : ranks_) {
    auto it = rank_state.steps.find(step);
    if (it != rank_state.steps.end() && it->second.state == v1::STEP_STATE_CAPTURED) {
      committing[rank] = &it->second;
    }
  }
  if (absl::Status status = WriteJournal(committing, cluster); !status.ok()) {
    return status;
  }
  cluster_ = cluster;
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
  return absl::OkStatus();
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

absl::Status Store::InstallImage(const NodeImage& image, const v1::JournalCluster& cluster) {
  std::map<uint32_t, RankState> rebuilt;
  for (int i = 0; i < image.manifest().regions_size(); ++i) {
    const v1::ImageRegion& region = image.manifest().regions(i);
    rebuilt[region.rank()].committed[region.region()] = VersionFrom(region, image.stored()[i]);
  }
  for (const v1::JournalRank& rank : image.manifest().ranks()) {
    LoadRankRecord(rank, &rebuilt[rank.rank()]);
  }
  absl::MutexLock lock(&mutex_);
  prepared_steps_.clear();  // the installed state decides from here
  // Registered regions (a trainer already waiting to restore) stay; everything stored is replaced.
  for (auto& [rank, rank_state] : ranks_) {
    RankState& installed = rebuilt[rank];
    installed.regions = rank_state.regions;
    installed.restarting = rank_state.restarting;
    installed.replay_through = rank_state.replay_through;
  }
  std::swap(ranks_, rebuilt);
  if (absl::Status status = WriteJournal({}, cluster); !status.ok()) {
    std::swap(ranks_, rebuilt);
    for (auto& [rank, rank_state] : rebuilt) ranks_[rank].regions = rank_state.regions;
    return status;
  }
  cluster_ = cluster;
  notified_step_ = NodeCommittedStep();  // a rebuilt step is not a new commit: nothing to drain
  step_changed_.SignalAll();
  return absl::OkStatus();
}

v1::JournalCluster Store::ClusterRecord() const {
  absl::MutexLock lock(&mutex_);
  return cluster_;
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
  for (const std::shared_ptr<Version>& version : versions) {
    v1::NodeImage manifest;
    AddToImage(*version, &manifest);
    if (absl::Status status = WriteRegion(rank, manifest.regions(0), *version->stored);
        !status.ok()) {
      return status;
    }
    v1::RestoreResponse::Restored* restored = response.add_regions();
    restored->set_region(version->region);
    restored->set_step(version->step);
    restored->set_bytes(version->bytes);
    version->SavePiece(restored);
  }
  return response;
}

}  // namespace moesnap::daemon
