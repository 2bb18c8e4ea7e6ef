// The trainer's side of moesnap: connect to the node's moesnapd, register the regions that make up a
// rank's training state, snapshot them after each optimizer step, and restore them after a crash.
//
// The consistency rule: parameters change only in the optimizer step. Call Snapshot(step) right after
// it (it returns at once; the daemon copies while forward and backward run) and WaitCaptured(step)
// before the next optimizer step. For GPU regions, Snapshot records an event on the trainer's stream
// that the daemon waits on before copying.
//
// Ownership: a Client owns its connections; registered host regions must stay allocated (hold
// their SharedBuffer, keep shared descriptors open) while registered. Thread safety: all methods
// may be called from several threads; calls are serialized per Client where the protocol needs it.
#ifndef MOESNAP_CLIENT_CLIENT_H_
#define MOESNAP_CLIENT_CLIENT_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "moesnap/shared_buffer.h"

namespace moesnap {
namespace v1 {
class RestoreRequest;  // the wire schema stays out of the public header
class SnapshotRequest;
}  // namespace v1

struct ClientOptions {
  std::string socket_path = "/run/moesnap/agent.sock";
  uint32_t rank = 0;
  // What a launcher (torchrun, Slurm, a Kubernetes pod) sets: the socket from MOESNAP_SOCKET, else
  // the default above; the rank from RANK, else LOCAL_RANK, else 0. INVALID_ARGUMENT names a
  // variable that is set but is not a rank.
  static absl::StatusOr<ClientOptions> FromEnvironment();
  // How long Connect and each short call may take. A call that runs out of it has the daemon's
  // health checked (gRPC's health check, answered within a second by any daemon that serves):
  // while the daemon serves nothing (stopped), every call is refused at once with UNAVAILABLE,
  // until it answers a check again. Such a daemon costs a trainer one call timeout and a second,
  // not a call timeout every step. (A daemon that serves but whose calls are blocked answers
  // health checks: its calls run out one by one.)
  std::chrono::milliseconds call_timeout{30000};
  // How long WaitCaptured / WaitCommitted / Restore may wait for copies in flight. WaitCaptured
  // and WaitCommitted ask in calls of at most call_timeout each, so a daemon that stops answering
  // ends them after one.
  std::chrono::milliseconds wait_timeout{std::chrono::minutes(10)};
};

// Describes a region: its name (unique within the rank), dtype and shape are metadata the daemon
// stores and checks on restore.
struct RegionInfo {
  std::string name;
  std::string dtype;           // e.g. "float32"; empty: unchecked
  std::vector<int64_t> shape;  // empty: unchecked
};

// Data-parallel replicas: ranks that hold identical copies of some regions (Client::SetReplicaGroup).
struct ReplicaGroup {
  std::string name;             // the same on every member
  std::vector<uint32_t> ranks;  // every member, in the same order on each: member i holds shard i
};

// GPU memory: `bytes` bytes at `address` on `device`, inside one cudaMalloc allocation (the client
// finds the allocation and shares it whole by CUDA IPC, however many regions lie in it). `stream` is
// the trainer's cudaStream_t that writes the region (null: the legacy default stream), on which
// Snapshot records the capture event.
struct DeviceMemory {
  int device = 0;
  void* address = nullptr;
  size_t bytes = 0;
  void* stream = nullptr;
};

// A shared-memory file handed to the daemon (Client::ShareMemory), by a handle that stays valid
// across reconnections to a restarted daemon.
using MemoryHandle = uint64_t;

// A shared-memory file that an exited process of this rank left with the daemon (AdoptMemory).
struct AdoptedMemory {
  int fd = -1;              // the caller's: kept open while regions in it are registered
  MemoryHandle memory = 0;  // handed over already: regions in it are registered directly
};

// A host region inside shared memory handed over with ShareMemory.
struct HostRegion {
  RegionInfo info;
  MemoryHandle memory = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct DeviceRegion {
  RegionInfo info;
  DeviceMemory memory;
};

struct RestoredRegion {
  std::string name;
  int64_t step = 0;  // the step whose bytes the region now holds
  uint64_t bytes = 0;
};

// Where a restore's state came from: the daemons' memory, or the durable tier on disk (when memory
// no longer holds the committed state: a fresh pool after a power loss, more than m nodes of a
// group lost, a new set of machines).
enum class RestoreTier { kMemory, kDurable };

struct RestoreResult {
  int64_t step = 0;  // the committed step restored
  std::vector<RestoredRegion> regions;
  RestoreTier tier = RestoreTier::kMemory;
  // RestoreFrom in a cluster: the node whose snapshot served it, and whether that node was lost
  // (its regions decoded from its group's parity).
  std::optional<uint32_t> source_node;
  bool decoded = false;
};

// A sparse step's place in its window: window j of W steps holds steps j*W+1 .. j*W+W, slot i being
// step j*W+1+i. The daemon commits the window when all its slots have committed.
struct SparseSlot {
  int64_t window_first_step = 0;
  uint32_t window_size = 0;
  uint32_t slot = 0;
  uint32_t buffer = 0;                 // which of the trainer's two sets of regions it writes
  std::vector<std::string> operators;  // operators whose full state this slot captures
};

struct WindowSlotState {
  uint32_t slot = 0;
  int64_t step = 0;
  bool committed = false;
  std::vector<std::string> operators;
};

struct SparseWindow {
  int64_t first_step = 0;
  uint32_t size = 0;
  uint32_t buffer = 0;
  std::vector<WindowSlotState> slots;  // as far as they were snapshotted
  std::string failure;                 // why a slot aborted, if one did
};

struct SparseWindows {
  std::optional<SparseWindow> committed;  // the last window all of whose slots committed
  std::optional<SparseWindow> open;       // the window after it
};

// Upstream logging at pipeline-stage boundaries.
enum class LogDirection {
  kForward,   // activations sent downstream
  kBackward,  // gradients sent upstream
};

struct LoggedMessage {
  uint32_t micro_batch = 0;
  std::string payload;
};

// Riding through a daemon restart: when a call finds the daemon gone, the client connects again
// once the daemon is back (at that call or a later one), hands its memory over again and registers
// every region again, then carries on; calls made while it is down fail with UNAVAILABLE. A step
// whose capture was lost with the daemon counts as captured (its regions may change) and is
// reported by TakeSkippedSteps(). The restarted daemon still holds every committed step.
class Client {
 public:
  // Connects and starts a session for `options.rank` (forgetting regions an earlier process of the
  // rank registered). UNAVAILABLE at once, naming the socket, when no daemon answers there;
  // INVALID_ARGUMENT when MOESNAP_HUGE_PAGES holds neither 0 nor 1 (see SharedBuffer).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  // Ends the session. A snapshot whose capture has not ended is abandoned (as when WaitCaptured
  // fails): the regions may change at once, and that capture is aborted.
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Allocates host memory the daemon can map (SharedBuffer::Allocate: in huge pages under
  // MOESNAP_HUGE_PAGES=1).
  absl::StatusOr<std::shared_ptr<SharedBuffer>> AllocateHost(size_t bytes) const;

  // Hands shared-memory files (memfd, or /dev/shm files such as PyTorch's shared storages) to the
  // daemon, which maps each once; returns a handle per descriptor, in order. The descriptors must
  // stay open, and the files unshrunk, while regions in them are registered: the client keeps the
  // numbers, not copies, to hand them over again after a daemon restart.
  absl::StatusOr<std::vector<MemoryHandle>> ShareMemory(const std::vector<int>& fds);
  // Takes a shared-memory file holding `bytes` bytes (of exactly that size, or in huge pages
  // rounded up to whole ones, as SharedBuffer allocates it) that an exited process of this rank left
  // with the daemon (kept for [agent] exited_trainer_memory_seconds), handed over and mapped by the
  // daemon already: a restarted trainer skips allocating fresh memory, filling it and the daemon's
  // mapping of it. Its bytes are the exited process's, not zeros: restore or write every byte
  // before reading one. nullopt when the daemon keeps no such file for this rank (allocate then).
  absl::StatusOr<std::optional<AdoptedMemory>> AdoptMemory(size_t bytes);
  // The same, mapped here as a SharedBuffer that RegisterHostRegion takes without handing it over
  // again, and that stays mapped while the client lives; nullptr when there is none.
  absl::StatusOr<std::shared_ptr<SharedBuffer>> AdoptHost(size_t bytes);
  // Registers regions inside shared memory, all in one call (O(regions), whatever the files' size).
  absl::Status RegisterHostRegions(const std::vector<HostRegion>& regions);
  // Registers `bytes` bytes at `offset` of `buffer` as a region (handing the buffer over once).
  absl::Status RegisterHostRegion(const RegionInfo& info, std::shared_ptr<SharedBuffer> buffer,
                                  size_t offset, size_t bytes);
  // Registers GPU memory shared by CUDA IPC, all in one call. The first such call loads the CUDA
  // driver (libcuda.so.1; nothing of CUDA is linked in): FAILED_PRECONDITION when it cannot be
  // loaded, or when the daemon has no GPU backend. Regions written on the same stream share one
  // capture event.
  absl::Status RegisterDeviceRegions(const std::vector<DeviceRegion>& regions);
  // The same for one region.
  absl::Status RegisterDeviceRegion(const RegionInfo& info, const DeviceMemory& memory);
  // Declares that registered `regions` (every registered region when empty) are identical on the
  // ranks of `group`, this rank among them (data-parallel replicas). From then on each member's
  // snapshots copy only its shard: the group's regions in name order, laid end to end and cut
  // into N equal byte ranges (4 KiB aligned; a region may span shards). A step commits only with
  // every member's shard, and Restore assembles each region from all of them, as one call; the
  // layout is recorded with each step, so a job restarted with another group size restores from
  // the old shards. Every member declares the same name and ranks for regions of the same names
  // and sizes. An empty `group.ranks` makes the regions whole again. INVALID_ARGUMENT for a
  // group without this rank, NOT_FOUND for a region not registered.
  absl::Status SetReplicaGroup(const ReplicaGroup& group,
                               const std::vector<std::string>& regions = {});

  // Starts the capture of `regions` (every registered region when empty) at `step` and returns the
  // bytes the daemon will copy. Returns as soon as the copies are queued. A step the daemon skips
  // (TakeSkippedSteps says why) copies 0 bytes and is not an error: training goes on.
  absl::StatusOr<uint64_t> Snapshot(int64_t step, const std::vector<std::string>& regions = {});
  // The same for a sparse step, slot `slot` of its window.
  absl::StatusOr<uint64_t> SnapshotSparse(int64_t step, const std::vector<std::string>& regions,
                                          const SparseSlot& slot);
  // Blocks until the regions of `step` are copied: from then on they may change again. OK also when
  // the cluster aborted the step after the copy (a node lost during its commit): that snapshot is
  // lost, the previous committed state stays, and training goes on. When it fails (wait_timeout ran
  // out, the daemon did not answer), as when Snapshot fails, the client first marks the snapshot
  // abandoned in memory it shares with the daemon: a capture still copying then ends aborted, so
  // the regions may change at once.
  absl::Status WaitCaptured(int64_t step);
  // Blocks until `step` is committed (restorable after a crash).
  absl::Status WaitCommitted(int64_t step);
  // Makes the regions' present state committed as `step`: call it for the last step of training
  // (or before a planned stop) instead of Snapshot. It lets the rank's earlier steps settle first,
  // so the pool has room, then takes `step` (again, if the daemon skipped it or went away) until
  // it commits or wait_timeout runs out; while the daemon that took the step serves nothing, it
  // waits for that daemon (which may still commit the step). ABORTED when the cluster aborted
  // `step` (a node lost during its commit): a cluster's decision on a step is final. When it fails,
  // it first marks what it took abandoned, as WaitCaptured does.
  absl::Status Commit(int64_t step);

  // Writes the latest committed state (or `step`, which must be the latest) into the registered
  // regions (all when `regions` is empty), checking every chunk's checksum. When memory no longer
  // holds the committed state, the daemon restores the newest step durable on every node instead
  // (`tier` says which served it); LatestCommitted already names that step.
  absl::StatusOr<RestoreResult> Restore(std::optional<int64_t> step = std::nullopt,
                                        const std::vector<std::string>& regions = {});
  // Elastic restore: the latest committed regions that rank `source_rank` snapshotted (on any node
  // of the cluster; decoded from parity if its node is lost) into this rank's registered regions of
  // the same names (all of the source rank's when `regions` is empty).
  absl::StatusOr<RestoreResult> RestoreFrom(uint32_t source_rank,
                                            const std::vector<std::string>& regions = {});
  absl::StatusOr<std::optional<int64_t>> LatestCommitted();
  absl::StatusOr<SparseWindows> Windows();

  // Keeps what this rank sent to `peer_rank` at a pipeline boundary in the daemon's upstream log.
  // Logging the same message again is accepted; different bytes are refused (FAILED_PRECONDITION),
  // and RESOURCE_EXHAUSTED when upstream_log.max_bytes is reached.
  absl::Status AppendLog(int64_t step, uint32_t micro_batch, LogDirection direction,
                         uint32_t peer_rank, std::string_view payload);
  // What rank `sender_rank` (on any node of the cluster) sent to `peer_rank` at `step`, by
  // micro-batch, each checked against its CRC-32C. NOT_FOUND when no live node holds the sender's
  // log, OUT_OF_RANGE when the step was dropped, DATA_LOSS when it did not fit.
  absl::StatusOr<std::vector<LoggedMessage>> FetchLog(uint32_t sender_rank, int64_t step,
                                                      LogDirection direction, uint32_t peer_rank);

  // Starts a new session with the daemon (after it restarted): hands the memory over again and
  // registers every region again. The calls above do it by themselves when they find the daemon
  // gone.
  absl::Status Reconnect();

  // Steps this client asked to snapshot that were not: skipped by the daemon (earlier steps still
  // waiting for their commit, or no room in its pool) or lost with a daemon that went away; each
  // with the reason. Cleared by the call.
  std::vector<std::pair<int64_t, std::string>> TakeSkippedSteps();

  uint32_t rank() const;
  uint32_t node_id() const;

 private:
  struct State;
  explicit Client(std::unique_ptr<State> state);
  absl::StatusOr<RestoreResult> RestoreWith(v1::RestoreRequest request,
                                            const std::vector<std::string>& regions);
  absl::StatusOr<uint64_t> SnapshotWith(v1::SnapshotRequest request,
                                        const std::vector<std::string>& regions);
  // WaitCaptured / WaitCommitted: the wait, and the abandon mark raised unless it heard the answer.
  absl::Status Wait(int64_t step, bool until_committed);
  // The wait alone, until `deadline`, for a caller that does not go on when it fails (Commit,
  // which waits again).
  absl::Status WaitWithoutGivingUp(int64_t step, bool until_committed,
                                   std::chrono::steady_clock::time_point deadline);
  // Commit's tries, until `step` commits, cannot, or wait_timeout runs out.
  absl::Status CommitTrying(int64_t step);
  std::unique_ptr<State> state_;
};

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_CLIENT_H_
