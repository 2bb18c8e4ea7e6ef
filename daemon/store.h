// The store: versions of every region of every rank on this node, keyed by (rank, region, step), and
// the life of each step: capturing -> captured -> committed (or aborted). A region's last committed
// version stays until a newer one commits, so a failure mid-snapshot never loses the previous state.
// Every chunk carries a CRC-32C computed during the copy and checked on restore and verify.
#ifndef MOESNAP_DAEMON_STORE_H_
#define MOESNAP_DAEMON_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/abandon_mark.h"
#include "daemon/cluster_store.h"
#include "daemon/copy_backend.h"
#include "daemon/durable_store.h"
#include "daemon/group_pieces.h"
#include "daemon/journal.h"
#include "daemon/node_image.h"
#include "daemon/pool.h"
#include "daemon/rank_activity.h"
#include "daemon/worker_pool.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

struct CopyPlan;

struct CaptureOptions {
  int threads = 2;
  uint64_t chunk_bytes = uint64_t{4} << 20;  // unit of copy, CRC and (later) transfer
  // Dense steps of one rank captured or capturing and not yet committed (0: as many as the pool
  // holds): a further snapshot is skipped (answered, counted, never an error) until one commits.
  // A sparse window's slots are bounded by the window instead.
  int max_in_flight_steps = 0;
  // In a cluster, a rank whose trainer has not snapshotted for this long is left out of the node's
  // steps until it does (RankActivity); zero: never.
  absl::Duration idle_rank_timeout = absl::Minutes(10);
  // In a cluster, a node that runs no trainers (it holds its group's parity, say beside nodes of
  // data-parallel ranks) takes part in each step with no trainer registered. Otherwise a step waits
  // for a trainer on every node, so that one not registered yet is never left out of a step.
  bool parity_only = false;
  // In a cluster, parity_units / data_units (zero on a single node): the parity a node holds for
  // one step is about that share of the group's largest image. Captures leave room for it, so that
  // steps captured faster than the cluster commits them never fill the pool and starve the parity
  // of the step being encoded (then every step aborts, and nothing commits again).
  double parity_share = 0;
};

// The copy backends the store may use; `device` is null when no GPU backend is available.
struct CopyBackends {
  CopyBackend* host = nullptr;
  CopyBackend* device = nullptr;
};

// Regions one rank may hold, all its registrations together: the largest MoE ranks hold tens of
// thousands of tensors; each region costs the daemon its name, record and plan entries.
inline constexpr size_t kMaxRegionsPerRank = size_t{1} << 18;
// Ranks a store knows at once: those with a trainer connected and those holding state (committed,
// or steps). As many as one node image may hold (PeerLimits::kMaxRanksPerImage). A rank whose
// trainer leaves holding nothing is forgotten; the bound stops trainers that take a step under
// rank after rank from growing the daemon without end.
inline constexpr size_t kMaxRanksKnown = size_t{1} << 16;

// Who commits a captured step: the store itself (one node: the journal write is the commit point),
// or the cluster's two-phase commit (CommitNodeStep / AbortNodeStep).
enum class CommitMode { kLocal, kCluster };

// Thread-safe: every public method may be called from any gRPC thread. In a cluster, the cluster
// uses the store only through ClusterStore; the durable tier uses it only through DurableStore.
class Store final : public ClusterStore, public DurableStore {
 public:
  // Recovers the committed versions recorded in the journal into the pool.
  static absl::StatusOr<std::unique_ptr<Store>> Open(Pool* pool, Journal* journal,
                                                     CopyBackends backends,
                                                     const CaptureOptions& options,
                                                     CommitMode mode = CommitMode::kLocal);
  ~Store() override;

  // A trainer process of `rank` connects (session: its TrainerSessions number): forget the regions
  // a previous process of the rank registered. RESOURCE_EXHAUSTED for a rank not known here while
  // kMaxRanksKnown are.
  absl::Status StartSession(uint32_t rank, uint64_t session);
  // That process is gone (its memory connection closed): forget its regions, unless a newer
  // process of the rank started since. A rank left holding nothing is forgotten (HoldsNothing).
  void EndSession(uint32_t rank, uint64_t session);
  // Whether a copy into or out of `rank`'s trainer memory (a capture, a restore), for any process
  // of the rank, is queued or running: an exited process's memory is handed on only when none is.
  bool CopyingTrainerMemory(uint32_t rank) const;

  // Adds or replaces named regions of a rank, up to kMaxRegionsPerRank in all (registrations add
  // up). Refused while a step of the rank is capturing, when no process of the rank is connected
  // (it ended), and when a newer process of the rank started (StartSession) during the call. The regions passed CheckRegisterRegions
  // (request_checks.h) for `rank`.
  absl::Status RegisterRegions(uint32_t rank, const std::vector<v1::RegionSpec>& regions);

  // Queues the copies of `regions` (all registered regions when empty) for `step` and returns the
  // bytes to copy, at once. The step must come after every earlier snapshot of the rank. A step
  // that cannot be taken now (capture.max_in_flight_steps reached, or the pool cannot hold it) is
  // skipped: the response says why, the step counts as aborted, and the trainer goes on.
  // A sparse step names its slot of a window: slot 0 opens the window, later slots continue it in
  // order (FAILED_PRECONDITION otherwise); the window commits when all its slots have. The step and
  // slot passed CheckSnapshot (request_checks.h). A step taken while the rank's last one is still
  // capturing (its trainer gave up waiting for it) is skipped. A capture whose trainer marked it
  // abandoned (`abandon_mark`) by the time its copy ends is aborted: the trainer may have changed
  // its memory during the copy.
  absl::StatusOr<v1::SnapshotResponse> Snapshot(
      uint32_t rank, int64_t step, const std::vector<std::string>& regions,
      const std::optional<v1::SparseSlot>& sparse = std::nullopt,
      std::optional<AbandonMark> abandon_mark = std::nullopt);

  // Waits until `step` is captured (or committed) and returns its state; the step's failure if it
  // failed. `cancelled` is polled so a client that goes away frees the thread.
  absl::StatusOr<v1::StepState> WaitCaptured(uint32_t rank, int64_t step, absl::Time deadline,
                                             const std::function<bool()>& cancelled);
  absl::StatusOr<v1::StepState> WaitCommitted(uint32_t rank, int64_t step, absl::Time deadline,
                                              const std::function<bool()>& cancelled);

  // Writes the latest committed version of each requested region (all registered regions when
  // empty) back into the rank's registered regions, checking every chunk's CRC. Restoring every
  // region starts a new timeline: the rank's later steps, captured and not committed, are dropped.
  // A step of the rank still capturing (a crashed trainer's last snapshot) is waited for first, up
  // to `deadline`, so that it can become the state restored. In a cluster the caller first waits
  // until the node holds its share of the committed state (Cluster::WaitRestorable).
  // A region of a replica group is assembled from every member's piece. Pieces of members whose
  // state this node does not hold (they ran on other nodes) are UNAVAILABLE when `remote` is null;
  // otherwise the restore writes the pieces held here and lists the region in `remote`, for the
  // caller to fetch the rest (FetchRemotePieces) and check the whole cover.
  absl::StatusOr<v1::RestoreResponse> Restore(uint32_t rank, std::optional<int64_t> step,
                                              const std::vector<std::string>& regions,
                                              absl::Time deadline,
                                              std::vector<GroupRegion>* remote = nullptr);

  std::optional<int64_t> LatestCommitted(uint32_t rank) const;
  // Waits until no step of `rank` is capturing or being decided by the cluster, so that the latest
  // committed step is what a restore would give.
  absl::Status WaitSettled(uint32_t rank, absl::Time deadline);
  // The rank's last committed sparse window and the open one after it.
  v1::RankWindows Windows(uint32_t rank) const;
  v1::ListWindowsResponse ListWindows(std::optional<uint32_t> rank) const;
  // The step the given ranks recover from at worst: the first step of each one's last committed
  // window, or its latest committed step when it takes no sparse steps. Upstream-log records of
  // steps up to it are no longer needed (windows are aligned across the job, so a rank's own window
  // stands for its neighbours'). Absent while one of them has nothing committed or its first window
  // is still open.
  std::optional<int64_t> LogRecoveryPoint(const std::set<uint32_t>& ranks) const;

  // --- Cluster mode: ClusterStore ----------------------------------------------------------
  absl::StatusOr<int64_t> WaitNewNodeCapture(absl::Time deadline) override;
  NodeCapture CaptureOf(int64_t step) const override;
  absl::StatusOr<NodeImage> WaitNodeCaptured(int64_t step, absl::Time deadline) override;
  // The committed image (what parity of the committed step covers), with each rank's record.
  NodeImage CommittedImage() const override;
  absl::StatusOr<std::vector<std::shared_ptr<PoolBytes>>> CommittedBytesOf(
      const v1::NodeImage& image, absl::Span<const int> positions) const override;
  absl::StatusOr<HeldRegion> CommittedRegion(int64_t step, uint32_t rank,
                                             const std::string& region) const override;
  // A node whose ranks did not take part (none registered) records only `cluster`.
  absl::StatusOr<std::shared_ptr<const v1::JournalCluster>> CommitNodeStep(
      int64_t step, v1::JournalCluster cluster, std::vector<std::string> image_bytes) override;
  void AbortNodeStep(int64_t step, const absl::Status& why) override;
  absl::Status InstallImage(const NodeImage& image, v1::JournalCluster cluster) override;
  void ForgetClusterRecord() override;
  absl::Status WriteRegion(uint32_t rank, const v1::ImageRegion& stored,
                           const PoolBytes& bytes) override;
  absl::StatusOr<v1::RestoreResponse> RestoreFromRank(
      uint32_t rank, uint32_t source_rank, const std::vector<std::string>& regions) override;
  std::shared_ptr<const v1::JournalCluster> ClusterRecord() const override;
  RecordWithBytes ClusterRecordWithBytes() const override;
  absl::Status JournalRoomFor(const NodeImage& own, int own_position,
                              const std::vector<std::string>& group_images,
                              uint64_t stripes) const override;
  uint64_t CommittedBytes() const override;
  uint64_t InFlightBytes() const override;

  // --- Durable tier: DurableStore ------------------------------------------------------------
  void SetCommitObserver(CommitObserver* observer) override;
  absl::Status AdoptCommitted(uint32_t rank, const std::vector<v1::ImageRegion>& regions,
                              const v1::JournalRank& record, const ChunkSource& read) override;

  // Admin views and operations.
  v1::StatusResponse Status() const;
  v1::ListStepsResponse ListSteps() const;
  v1::InspectStepResponse InspectStep(int64_t step, std::optional<uint32_t> rank) const;
  v1::VerifyResponse Verify(std::optional<int64_t> step) const override;
  absl::StatusOr<v1::DropStepResponse> DropStep(int64_t step, std::optional<uint32_t> rank);
  // Leaves `rank` out of the node's steps until its next Snapshot (moesnapctl drop-rank):
  // FAILED_PRECONDITION when no trainer of it is registered on this node.
  absl::Status DropRank(uint32_t rank);

 private:
  struct Version;
  // A rank's committed versions by region name (looked up by std::string_view too).
  using CommittedVersions = std::map<std::string, std::shared_ptr<Version>, std::less<>>;
  struct StepRecord;
  struct RankState;
  struct RegionTable;
  struct CaptureJob;
  class CopyInFlight;

  Store(Pool* pool, Journal* journal, CopyBackends backends, const CaptureOptions& options,
        CommitMode mode);
  absl::Status Recover();
  template <typename Saved>
  static std::shared_ptr<Version> VersionFrom(const Saved& saved, std::shared_ptr<PoolBytes> stored);
  // `version`'s entry in the journal state (its field's tag and length, then the entry), made at
  // its first journal write in `scratch`, whose allocations the next one reuses.
  static const std::string& JournalFieldOf(const Version& version, v1::JournalVersion& scratch);
  CopyBackend* BackendFor(v1::Device device) const;
  // Whether the rank has nothing a later process of it needs: no trainer connected, nothing
  // committed or recorded for the journal, no step (not even a skipped one, which a replaying
  // process is answered from), no copy of its memory in flight.
  static bool HoldsNothing(const RankState& rank_state);
  // Forgets the ranks that hold nothing, but for the members of a replica group that a trainer
  // here declares, or that a step not decided yet captures: the group's step waits for them
  // (RanksStillCapturing, and with no trainer left, NodeCaptured counts every rank known).
  void ForgetRanksHoldingNothing() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // A step of the rank, captured and not decided, that this node voted to commit.
  std::optional<int64_t> PreparedStepOf(const RankState& rank_state) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  absl::Status AwaitSettled(uint32_t rank, const RankState& rank_state, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The rank's journal record once `committing` (may be null) commits; absent with nothing committed.
  static std::optional<v1::JournalRank> RankRecordAfter(uint32_t rank, const RankState& rank_state,
                                                        const StepRecord* committing);
  static void LoadRankRecord(const v1::JournalRank& saved, RankState* rank_state);
  // Calls visit(version) for the rank's committed versions once `committing` (may be null)
  // commits, in region name order. Allocates nothing per version: a commit of a rank of thousands
  // of regions walks them once.
  template <typename Visit>
  static void ForEachVersionAfter(const RankState& rank_state, const StepRecord* committing,
                                  Visit visit);
  // The replica-group layouts once `record` commits, into `groups`; with `committed`, also drops
  // the pieces a whole step left behind (its shard no longer covers them).
  static void CommitReplicaGroups(const StepRecord& record,
                                  CommittedVersions* committed,
                                  std::map<std::string, v1::ReplicaGroupStep>* groups);
  // The committed layout of the replica group `spec`'s region belongs to in the rank's state (its
  // `stored` piece, null when its shard holds none of the region); null when there is none.
  const v1::ReplicaGroupStep* LayoutOf(const RankState& rank_state, const v1::RegionSpec& spec,
                                       const Version* stored) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The members' pieces of a region this node holds, and the members it holds nothing of.
  struct HeldPieces {
    std::vector<std::shared_ptr<Version>> versions;
    std::vector<GroupPiece> pieces;  // the same, as the cover check sees them
    std::vector<uint32_t> remote_members;
  };
  // Every member's piece of `region` under the committed `layout`. With every member held here,
  // an error unless they are of one step and cover the region exactly once; a member held
  // elsewhere is UNAVAILABLE unless `allow_remote` (then listed, and the cover is the caller's).
  absl::StatusOr<HeldPieces> GroupPieces(const v1::ReplicaGroupStep& layout,
                                         const std::string& region, bool allow_remote) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // On a single node: whether every member of the replica groups of `rank`'s step (and of theirs)
  // has captured `step`; `committing` (holding `rank`'s record) receives their records.
  bool GroupCaptured(uint32_t rank, int64_t step,
                     std::map<uint32_t, const StepRecord*>* committing) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // A version of the region at `position` of a capture, in its part of the step's reservation.
  std::shared_ptr<Version> NewVersion(const CaptureJob& job, uint32_t position) const;
  // Copies one part of a step's capture; the last part to finish ends the capture.
  void CapturePart(const std::shared_ptr<CaptureJob>& job, size_t part);
  // Called when the last chunk of a step is copied: commits it on a single node (captured ==
  // ready); in a cluster, marks it captured and tells the cluster once the whole node has it.
  void FinishStep(RankState& rank_state, uint32_t rank, StepRecord& record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void CommitRecord(RankState& rank_state, uint32_t rank, StepRecord& record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // True when every rank with registered regions has captured `step` (and one has), false while
  // one is still capturing or has not started it; the failure when a rank's copy of it aborted.
  // With no trainer registered (and not parity-only), true only when every rank known here
  // captured it.
  absl::StatusOr<bool> NodeCaptured(int64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Whether a trainer has regions registered here now.
  bool AnyTrainerLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The ranks known here without a captured record of `step` (none, or discarded, or not captured).
  std::vector<uint32_t> RanksWithoutCapture(int64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Why `step` is not captured here, naming the ranks that hold it back, once NodeCaptured(step)
  // said it is not (without an error).
  std::string NotCapturedMessage(int64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // True when every rank with registered regions has snapshotted a later step in its present
  // timeline (and one has): a step none of them holds now is never captured here.
  bool PassedLocked(int64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The ranks with registered regions that have not captured `step` yet; the failure when a
  // rank's copy of it aborted.
  absl::StatusOr<std::vector<uint32_t>> RanksStillCapturing(int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // A superseded step is one a newer committed step replaced before it committed.
  enum class StepOutcome { kAborted, kSuperseded };
  void AbortStep(RankState& rank_state, StepRecord& record, absl::Status why,
                 StepOutcome outcome = StepOutcome::kAborted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void TrimFinishedSteps(RankState& rank_state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The pool bytes a capture must leave free in a cluster: the parity of two steps being encoded
  // (one whose Encode overlaps the next one's, and units rounded up to whole stripe units), at
  // parity_share of the largest image of the group, committed or to be captured here.
  uint64_t ParityReserveLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // What a step captures: positions in its region table, and the plan of their copy.
  struct Selection {
    std::shared_ptr<const std::vector<uint32_t>> regions;
    std::shared_ptr<const CopyPlan> plan;
  };
  // The regions a step of `rank` captures: every registered region (the table's own selection and
  // plan, made once at registration, so that a step of thousands of regions costs no work per
  // region here), or the regions `named`. A dense step that names some regions also takes every
  // region an earlier step of the rank's timeline captured and did not commit (skipped, aborted,
  // or still waiting): the trainer's memory holds their values as of this step, and without them
  // the step would not be a consistent state. A step of a timeline a whole restore ended changed
  // nothing that restore left. NOT_FOUND names a region the rank has not registered.
  absl::StatusOr<Selection> SelectRegions(uint32_t rank, const RankState& rank_state,
                                          const std::shared_ptr<const RegionTable>& table,
                                          const std::vector<std::string>& named, bool sparse) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Why a step copying `plan` is skipped instead of captured: the node offered the step to the
  // cluster without this rank, its sparse window can no longer commit, too many steps wait for
  // their commit, or the pool must keep its room for parity.
  // Empty when it may capture; an error when the step is refused (a sparse slot out of order,
  // judged before any reason to skip it).
  absl::StatusOr<std::string> SkipReason(uint32_t rank, RankState& rank_state, int64_t step,
                                         const std::optional<v1::SparseSlot>& sparse,
                                         const CopyPlan& plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Starts the capture of `step` into `reservation` (null when it copies nothing): its record, and
  // its parts on the copy threads. A sparse slot passed SparseWindows::Check; FAILED_PRECONDITION,
  // starting nothing, when its windows refuse it all the same.
  absl::StatusOr<v1::SnapshotResponse> StartCapture(
      uint32_t rank, RankState& rank_state, int64_t step,
      const std::optional<v1::SparseSlot>& sparse, std::shared_ptr<const RegionTable> table,
      Selection selection, std::shared_ptr<const PoolReservation> reservation,
      std::optional<AbandonMark> abandon_mark)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Records `step` of `rank`, meant to capture `regions`, as skipped (never captured) for `why`,
  // and the answer saying so. A sparse slot passed SparseWindows::Check; FAILED_PRECONDITION,
  // recording nothing, when its windows refuse it all the same.
  absl::StatusOr<v1::SnapshotResponse> Skip(
      RankState& rank_state, uint32_t rank, int64_t step,
      const std::optional<v1::SparseSlot>& sparse, std::shared_ptr<const RegionTable> table,
      std::shared_ptr<const std::vector<uint32_t>> selection, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Writes the journal state once the records in `committing` (rank -> step) commit, with
  // `cluster`, whose group images serialized are `image_bytes`: copies of bytes serialized before
  // (the images, each version's entry) around the few records serialized here.
  absl::Status WriteJournal(const std::map<uint32_t, const StepRecord*>& committing,
                            const v1::JournalCluster& cluster,
                            const std::vector<std::string>& image_bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The node's committed step: the cluster's, or on a single node the lowest latest committed
  // step of the ranks that committed one.
  std::optional<int64_t> NodeCommittedStep() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  NodeImage CommittedImageLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The committed version of `rank`'s region `region`; null when this node holds none.
  const Version* CommittedVersionLocked(uint32_t rank, const std::string& region) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Tells the commit observer when the node's committed step moved past `notified_step_`.
  void NotifyCommitted() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Waits until a step changes, a rank turns idle or `deadline` passes; the caller judges again.
  void WaitStepChanged(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  absl::StatusOr<v1::StepState> WaitFor(uint32_t rank, int64_t step, bool until_committed,
                                        absl::Time deadline, const std::function<bool()>& cancelled);

  Pool* const pool_;
  Journal* const journal_;
  const CopyBackends backends_;
  const CaptureOptions options_;
  const CommitMode mode_;
  const absl::Time started_ = absl::Now();
  mutable RankActivity activity_{options_.idle_rank_timeout};

  mutable absl::Mutex mutex_;
  std::map<uint32_t, RankState> ranks_ ABSL_GUARDED_BY(mutex_);
  uint64_t in_flight_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
  uint64_t steps_superseded_ ABSL_GUARDED_BY(mutex_) = 0;
  uint64_t snapshots_skipped_ ABSL_GUARDED_BY(mutex_) = 0;
  std::string last_skip_ ABSL_GUARDED_BY(mutex_);
  std::shared_ptr<const v1::JournalCluster> cluster_ ABSL_GUARDED_BY(mutex_) =
      std::make_shared<v1::JournalCluster>();
  // cluster_'s group images serialized, in order: what each journal write copies of them, and
  // what a participant builds the next step's images' bytes from.
  std::shared_ptr<const std::vector<std::string>> cluster_image_bytes_ ABSL_GUARDED_BY(mutex_) =
      std::make_shared<std::vector<std::string>>();
  CommitObserver* commit_observer_ ABSL_GUARDED_BY(mutex_) = nullptr;
  std::optional<int64_t> notified_step_ ABSL_GUARDED_BY(mutex_);  // the committed step last told
  absl::CondVar step_changed_;  // signalled when a step commits or aborts
  // Steps whose image this node handed to the cluster (it voted to commit them) and that are not
  // decided here yet: a rank's restore waits for them.
  std::set<int64_t> prepared_steps_ ABSL_GUARDED_BY(mutex_);
  // The memory of the node images handed to the cluster, back from the images of earlier steps:
  // the next is built over one, its entries keyed by their versions' serials.
  const std::shared_ptr<ManifestRecycler> image_memory_ = std::make_shared<ManifestRecycler>();

  // Declared last: destroyed first, so queued copies finish while the state they touch still lives.
  WorkerPool workers_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_STORE_H_
