// The store's private types (declared in store.h, defined here), shared by the files that
// implement Store: store.cc, store_restore.cc, store_operations.cc and store_cluster.cc. Not for
// use outside them.
#ifndef MOESNAP_DAEMON_STORE_TYPES_H_
#define MOESNAP_DAEMON_STORE_TYPES_H_

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/copy_plan.h"
#include "daemon/shard_layout.h"
#include "daemon/sparse_windows.h"
#include "daemon/store.h"

namespace moesnap::daemon {

struct Store::Version {
  // Names this version among every version the process makes: nothing of a version changes once
  // it is captured, so its serial names one content of its image entry (NodeImage::Entries' key).
  const uint64_t serial = NextSerial();
  static uint64_t NextSerial() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1, std::memory_order_relaxed);
  }
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
  // Its entry in the journal state, serialized by its first journal write (under the store's
  // lock, once its capture has filled its CRCs: nothing of a version changes after that).
  mutable std::string journal_field;

  bool is_piece() const { return !replica_group.empty(); }
  uint64_t RegionBytes() const { return is_piece() ? region_bytes : bytes; }
  // Writes what a record of the version holds (an image entry, a journal entry: VersionFrom reads
  // them back) into a cleared one; a journal entry's pool extents are its writer's.
  template <typename Saved>
  void Save(Saved* saved) const {
    saved->set_rank(rank);
    saved->set_region(region);
    saved->set_step(step);
    saved->set_bytes(bytes);
    saved->set_dtype(dtype);
    saved->mutable_shape()->Add(shape.begin(), shape.end());
    saved->set_chunk_bytes(chunk_bytes);
    saved->mutable_chunk_crcs()->Add(chunk_crcs.begin(), chunk_crcs.end());
    SavePiece(saved);
  }
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

  // The names, from one block of memory: a walk of the table in name order (a restore's, beside
  // the committed versions) reads them one after the other instead of each from its own string.
  std::string_view name(uint32_t index) const {
    return std::string_view(names).substr(name_starts[index],
                                          name_starts[index + 1] - name_starts[index]);
  }
  std::optional<uint32_t> Find(std::string_view name) const;  // the index of region `name`

  // A dtype and shape as registered. A model repeats a few of them over thousands of tensors: kept
  // once each, they stay in cache while a restore checks every region against what was stored.
  struct TensorType {
    std::string dtype;
    std::vector<int64_t> shape;
  };
  const TensorType& type(uint32_t index) const { return types[type_of[index]]; }

  std::vector<Region> regions;            // by name
  std::string names;                      // every region's name, in index order (name(index))
  std::vector<size_t> name_starts = {0};  // where each begins in `names`, and where the last ends
  std::vector<TensorType> types;          // the distinct ones among the regions
  std::vector<uint32_t> type_of;          // per index, its entry in `types`
  // Per index, what the rank captures of it: the whole region, or its shard of the region's
  // replica group (possibly nothing).
  std::vector<ShardPiece> pieces;
  std::map<std::string, v1::ReplicaGroup> groups;  // the regions' replica groups, by name
  std::vector<uint32_t> all;    // every index with a piece: what a whole-rank step captures
  // Per index, its place in the order of the trainer's memory (0 first; name order among regions
  // of no common order): what plans lay regions out and copy them in (CopyPlan::order).
  std::vector<uint32_t> place;
  std::shared_ptr<const CopyPlan> plan_of_all;

  // Per region, its place in the order of the trainer's memory.
  static std::vector<uint32_t> PlacesInMemory(const std::vector<Region>& regions,
                                              const std::vector<ShardPiece>& pieces);

  // The positions of `count` regions in the order of their places; index_of(position) is the
  // table index of the region at `position`.
  template <typename IndexOf>
  std::vector<uint32_t> InMemoryOrder(size_t count, IndexOf index_of) const {
    return OrderByRank(count, [&](uint32_t position) { return place[index_of(position)]; },
                       place.size());
  }
};

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
  std::optional<AbandonMark> abandon_mark;  // read once every part has copied
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

  bool Captures(std::string_view region) const {
    const std::optional<uint32_t> index = table->Find(region);
    return index && std::binary_search(selection->begin(), selection->end(), *index);
  }
};

struct Store::RankState {
  uint64_t session = 0;  // the trainer process registered now (TrainerSessions' number)
  bool connected = false;  // that process has not ended (StartSession, until its EndSession)
  std::shared_ptr<const RegionTable> regions = RegionTable::None();
  CommittedVersions committed;
  std::map<int64_t, StepRecord> steps;
  std::optional<int64_t> latest_committed;
  std::optional<int64_t> latest_snapshot;
  SparseWindows windows;
  // A new process of a rank with committed state connected and has not registered its regions
  // yet: in a cluster, steps wait for it (it snapshots the steps it replays) instead of
  // committing without it.
  bool restarting = false;
  // The steps a new process of the rank may replay, its predecessor's: from the one it replayed
  // last (none yet; taken again, as a client retrying its call does), through the latest snapshot
  // when it connected. Gone once the process asks for a step past them, or restores the whole
  // rank.
  struct Replay {
    int64_t through = 0;
    std::optional<int64_t> last;
    bool Allows(int64_t step) const { return step <= through && (!last || step >= *last); }
  };
  std::optional<Replay> replay;
  // The replica groups of the committed state, by name: who held which shard at which step.
  std::map<std::string, v1::ReplicaGroupStep> replica_groups;
  std::optional<v1::RankCapture> last_capture;  // what its last captured step copied
  // Copies of its trainer memory queued or running (CopyInFlight), of any of its sessions.
  std::shared_ptr<std::atomic<uint32_t>> copies = std::make_shared<std::atomic<uint32_t>>(0);
  // The per-region table of its last committed step's versions, emptied, its memory kept: the
  // next capture takes it, so that Snapshot() allocates nothing the size of the rank's region
  // count. Such an allocation cost a rank of 16,000 regions about 1 ms of Snapshot() whenever
  // the allocator first merged the thousands of small blocks the last commit had freed.
  std::vector<std::shared_ptr<Version>> spare_versions;

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

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_STORE_TYPES_H_
