/* The C ABI of libmoesnap (libmoesnap_c.so.2): the trainer's client, the sparse snapshot schedule
 * and the placement planner for callers that cannot use C++ — the Python package loads it with
 * ctypes, so no Python version is built into it. It is a thin layer over moesnap::Client
 * (moesnap/client.h), which stays the only speaker of the protocol; each function says which C++
 * call it is.
 *
 * Errors: every function that can fail returns a moesnap_status, 0 (MOESNAP_OK) on success, else a
 * status code as absl and gRPC number them (moesnap_status_name() gives "NOT_FOUND" for 5); the
 * message, naming the region, step and sizes involved, is moesnap_last_error() on the same thread,
 * valid until that thread's next call into this library. Outputs are written only on success. No
 * C++ exception crosses this interface.
 *
 * Objects passed in must be ones this library created and has not released. A function that
 * returns a moesnap_status refuses, with INVALID_ARGUMENT, a NULL pointer it does not allow.
 *
 * Ownership: objects this library creates (moesnap_client, moesnap_schedule, moesnap_log_messages,
 * strings) are the caller's, released with their _free/_close function. Strings passed in are
 * copied; arrays passed in are read during the call only.
 *
 * Threads: a moesnap_client may be used from several threads (calls are serialized where the
 * protocol needs it) and blocking calls block only the calling thread; schedules are immutable.
 *
 * Versions: MOESNAP_C_ABI_VERSION changes, with the library's soname, whenever a declaration here
 * changes incompatibly; moesnap_abi_version() is the version of the library actually loaded. */
#ifndef MOESNAP_CLIENT_MOESNAP_H_
#define MOESNAP_CLIENT_MOESNAP_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOESNAP_C_ABI_VERSION 2

#if defined(__GNUC__)
#define MOESNAP_C_API __attribute__((visibility("default")))
#else
#define MOESNAP_C_API
#endif

typedef int moesnap_status;
#define MOESNAP_OK 0

/* ---- Library ------------------------------------------------------------------------------ */

MOESNAP_C_API uint32_t moesnap_abi_version(void);
/* The release, e.g. "0.1.0". Static storage. */
MOESNAP_C_API const char* moesnap_version(void);
/* "OK", "NOT_FOUND", ... for a status code; "UNKNOWN" for a number that is none. Static storage. */
MOESNAP_C_API const char* moesnap_status_name(moesnap_status status);
/* The message of this thread's last failed call ("" before any). */
MOESNAP_C_API const char* moesnap_last_error(void);
/* Releases a string or array this library returned. NULL is ignored. */
MOESNAP_C_API void moesnap_free(void* pointer);

/* ---- Shared memory ------------------------------------------------------------------------ */

/* A sealed, zeroed shared-memory file holding `bytes` bytes, reserved now (moesnap::SharedBuffer's
 * file, not mapped; in huge pages under MOESNAP_HUGE_PAGES=1, rounded up to whole ones): the caller
 * maps the file's whole size (fstat: a mapping of huge pages unmaps in whole pages only), hands it to the daemon with moesnap_client_share_memory and
 * owns the descriptor. RESOURCE_EXHAUSTED when the system has no room; INVALID_ARGUMENT when
 * MOESNAP_HUGE_PAGES holds neither 0 nor 1. */
MOESNAP_C_API moesnap_status moesnap_shared_memory_create(size_t bytes, int* fd);

/* ---- Client: moesnap::Client -------------------------------------------------------------- */

typedef struct moesnap_client moesnap_client;

/* Client::Connect. `socket_path` NULL: MOESNAP_SOCKET, else the daemon's default socket; `rank`
 * below 0: RANK, else LOCAL_RANK, else 0. Timeouts in seconds (positive): each short call, and
 * the waits for copies in flight. UNAVAILABLE at once, naming the socket, when no daemon
 * answers. */
MOESNAP_C_API moesnap_status moesnap_client_connect(const char* socket_path, int64_t rank,
                                                    double call_timeout_s, double wait_timeout_s,
                                                    moesnap_client** client);
/* Ends the session and releases the client. NULL is ignored. */
MOESNAP_C_API void moesnap_client_close(moesnap_client* client);
MOESNAP_C_API uint32_t moesnap_client_rank(const moesnap_client* client);
MOESNAP_C_API uint32_t moesnap_client_node_id(const moesnap_client* client);

/* Client::ShareMemory: hands `count` shared-memory files to the daemon; handles[i] is the handle
 * of fds[i]. The descriptors must stay open while regions in them are registered. */
MOESNAP_C_API moesnap_status moesnap_client_share_memory(moesnap_client* client, const int* fds,
                                                         size_t count, uint64_t* handles);

/* Client::AdoptMemory: a shared-memory file holding `bytes` bytes (of exactly that size, or in huge
 * pages rounded up to whole ones: map its whole fstat size) that an exited process of this rank
 * left with the daemon, handed over already (*handle) and holding that process's bytes, not
 * zeros. *fd is the caller's (kept open while regions in it are registered); *fd is -1 and
 * *handle 0 when the daemon keeps no such file for this rank (allocate then). */
MOESNAP_C_API moesnap_status moesnap_client_adopt_memory(moesnap_client* client, size_t bytes,
                                                         int* fd, uint64_t* handle);

typedef struct moesnap_host_region {
  const char* name;      /* unique within the rank */
  uint64_t memory;       /* a handle from moesnap_client_share_memory or _adopt_memory */
  uint64_t offset;       /* into that file */
  uint64_t bytes;
  const char* dtype;     /* e.g. "float32"; NULL or "": unchecked on restore */
  const int64_t* shape;  /* shape_length dimensions; none: unchecked */
  size_t shape_length;
} moesnap_host_region;

/* Client::RegisterHostRegions, all in one call. */
MOESNAP_C_API moesnap_status moesnap_client_register_host_regions(
    moesnap_client* client, const moesnap_host_region* regions, size_t count);

typedef struct moesnap_device_region {
  const char* name;      /* unique within the rank */
  int32_t device;        /* CUDA device ordinal */
  uintptr_t address;     /* where the region starts, inside memory from cudaMalloc */
  uint64_t bytes;
  uintptr_t stream;      /* the trainer's CUDA stream that writes it (0: the legacy default) */
  const char* dtype;     /* e.g. "bfloat16"; NULL or "": unchecked on restore */
  const int64_t* shape;  /* shape_length dimensions; none: unchecked */
  size_t shape_length;
} moesnap_device_region;

/* Client::RegisterDeviceRegions, all in one call: GPU memory shared by CUDA IPC, regions of one
 * stream sharing one capture event. The CUDA driver (libcuda.so.1) is loaded by the first such
 * call, never before: FAILED_PRECONDITION when it cannot be, or when the daemon has no CUDA copy
 * backend. */
MOESNAP_C_API moesnap_status moesnap_client_register_device_regions(
    moesnap_client* client, const moesnap_device_region* regions, size_t count);

/* Client::SetReplicaGroup: `regions` (every registered region when count is 0) are identical on
 * the `rank_count` ranks of group `name` (every member, in the same order on each; none: whole
 * regions again); each member then snapshots only its shard of them. */
MOESNAP_C_API moesnap_status moesnap_client_set_replica_group(moesnap_client* client,
                                                              const char* name,
                                                              const uint32_t* ranks,
                                                              size_t rank_count,
                                                              const char* const* regions,
                                                              size_t count);

/* Client::Snapshot of `regions` (every registered region when count is 0); `bytes` (may be NULL)
 * receives the bytes the daemon will copy, 0 for a step the daemon skipped. */
MOESNAP_C_API moesnap_status moesnap_client_snapshot(moesnap_client* client, int64_t step,
                                                     const char* const* regions, size_t count,
                                                     uint64_t* bytes);

typedef struct moesnap_sparse_slot {
  int64_t window_first_step;
  uint32_t window_size;
  uint32_t slot;
  uint32_t buffer;
  const char* const* operators; /* whose full state this slot captures */
  size_t operator_count;
} moesnap_sparse_slot;

/* Client::SnapshotSparse. */
MOESNAP_C_API moesnap_status moesnap_client_snapshot_sparse(moesnap_client* client, int64_t step,
                                                            const char* const* regions,
                                                            size_t count,
                                                            const moesnap_sparse_slot* slot,
                                                            uint64_t* bytes);
/* Client::WaitCaptured, WaitCommitted, Commit. */
MOESNAP_C_API moesnap_status moesnap_client_wait_captured(moesnap_client* client, int64_t step);
MOESNAP_C_API moesnap_status moesnap_client_wait_committed(moesnap_client* client, int64_t step);
MOESNAP_C_API moesnap_status moesnap_client_commit(moesnap_client* client, int64_t step);

#define MOESNAP_TIER_MEMORY 0
#define MOESNAP_TIER_DURABLE 1

typedef struct moesnap_restored {
  int64_t step;         /* the committed step restored */
  uint64_t regions;     /* regions written */
  uint64_t bytes;       /* bytes written into them */
  int32_t tier;         /* MOESNAP_TIER_MEMORY or MOESNAP_TIER_DURABLE */
  int32_t decoded;      /* restore_from: the source node was lost, its regions decoded */
  int64_t source_node;  /* restore_from: the node whose snapshot served it; -1: none (one node) */
} moesnap_restored;

/* Client::Restore of `regions` (all when count is 0) at the latest committed step, or at `step`
 * when has_step is nonzero (it must be the latest). */
MOESNAP_C_API moesnap_status moesnap_client_restore(moesnap_client* client, int32_t has_step,
                                                    int64_t step, const char* const* regions,
                                                    size_t count, moesnap_restored* restored);
/* Client::RestoreFrom: rank `source_rank`'s latest committed regions into this rank's. */
MOESNAP_C_API moesnap_status moesnap_client_restore_from(moesnap_client* client,
                                                         uint32_t source_rank,
                                                         const char* const* regions, size_t count,
                                                         moesnap_restored* restored);
/* Client::LatestCommitted: *has_step 0 when nothing is committed. */
MOESNAP_C_API moesnap_status moesnap_client_latest_committed(moesnap_client* client,
                                                             int32_t* has_step, int64_t* step);
/* Client::Windows as JSON (release with moesnap_free): {"committed": W, "open": W}, each null or
 * {"first_step", "size", "buffer", "slots": [{"slot", "step", "committed", "operators": [...]}],
 * "failure"}. */
MOESNAP_C_API moesnap_status moesnap_client_windows(moesnap_client* client, char** json);
/* Client::TakeSkippedSteps as JSON (release with moesnap_free): [[step, "reason"], ...]. */
MOESNAP_C_API moesnap_status moesnap_client_take_skipped_steps(moesnap_client* client,
                                                               char** json);
/* Client::Reconnect. */
MOESNAP_C_API moesnap_status moesnap_client_reconnect(moesnap_client* client);

#define MOESNAP_LOG_FORWARD 0  /* activations sent downstream */
#define MOESNAP_LOG_BACKWARD 1 /* gradients sent upstream */

/* Client::AppendLog. */
MOESNAP_C_API moesnap_status moesnap_client_append_log(moesnap_client* client, int64_t step,
                                                       uint32_t micro_batch, int32_t direction,
                                                       uint32_t peer_rank, const void* payload,
                                                       size_t payload_bytes);

typedef struct moesnap_log_messages moesnap_log_messages;
/* Client::FetchLog: the messages by micro-batch, each checked against its CRC-32C. */
MOESNAP_C_API moesnap_status moesnap_client_fetch_log(moesnap_client* client, uint32_t sender_rank,
                                                      int64_t step, int32_t direction,
                                                      uint32_t peer_rank,
                                                      moesnap_log_messages** messages);
MOESNAP_C_API size_t moesnap_log_messages_count(const moesnap_log_messages* messages);
/* Message `index`: its micro-batch, and its payload, owned by `messages` (0 and NULL for an index
 * past the count). */
MOESNAP_C_API uint32_t moesnap_log_messages_micro_batch(const moesnap_log_messages* messages,
                                                        size_t index);
MOESNAP_C_API const void* moesnap_log_messages_payload(const moesnap_log_messages* messages,
                                                       size_t index, size_t* payload_bytes);
MOESNAP_C_API void moesnap_log_messages_free(moesnap_log_messages* messages);

/* ---- Sparse snapshot schedule: moesnap::SparseSchedule ------------------------------------ */

typedef struct moesnap_operator {
  const char* name;
  int32_t is_expert;
  uint64_t full_state_bytes;
  uint64_t weight_bytes;
  double token_count;
} moesnap_operator;

typedef struct moesnap_schedule moesnap_schedule;

/* SparseSchedule::Build. */
MOESNAP_C_API moesnap_status moesnap_schedule_build(const moesnap_operator* operators,
                                                    size_t count, double iteration_seconds,
                                                    double copy_bytes_per_second,
                                                    uint64_t every_step_bytes,
                                                    moesnap_schedule** schedule);
/* SparseSchedule::WithWindow. */
MOESNAP_C_API moesnap_status moesnap_schedule_with_window(const moesnap_schedule* schedule,
                                                          int32_t window,
                                                          moesnap_schedule** widened);
MOESNAP_C_API void moesnap_schedule_free(moesnap_schedule* schedule);
/* SparseSchedule::AgreedWindow. */
MOESNAP_C_API int32_t moesnap_schedule_agreed_window(const int32_t* windows, size_t count);
MOESNAP_C_API int32_t moesnap_schedule_window(const moesnap_schedule* schedule);
MOESNAP_C_API uint64_t moesnap_schedule_budget_bytes(const moesnap_schedule* schedule);
MOESNAP_C_API size_t moesnap_schedule_operator_count(const moesnap_schedule* schedule);
/* The capture order: operator indices, operator_count of them, into `order`. */
MOESNAP_C_API void moesnap_schedule_order(const moesnap_schedule* schedule, int32_t* order);
/* SparseSchedule::SlotOfStep (steps count from 1). */
MOESNAP_C_API int32_t moesnap_schedule_slot_of_step(const moesnap_schedule* schedule,
                                                    int64_t step);
/* Slot `slot`: its bytes, and the operators it captures whole into `captured` (room for
 * operator_count) with their number in *captured_count. OUT_OF_RANGE for no such slot. */
MOESNAP_C_API moesnap_status moesnap_schedule_slot(const moesnap_schedule* schedule, int32_t slot,
                                                   uint64_t* bytes, int32_t* captured,
                                                   size_t* captured_count);
/* SparseSchedule::CapturedBy into *captured (0 or 1). OUT_OF_RANGE for no such operator. */
MOESNAP_C_API moesnap_status moesnap_schedule_captured_by(const moesnap_schedule* schedule,
                                                          int32_t operator_index, int32_t slot,
                                                          int32_t* captured);
/* SparseSchedule::NeedsReorder, NeedsRegeneration: 1 or 0. */
MOESNAP_C_API int32_t moesnap_schedule_needs_reorder(const moesnap_schedule* schedule,
                                                     const double* token_counts, size_t count);
MOESNAP_C_API int32_t moesnap_schedule_needs_regeneration(const moesnap_schedule* schedule,
                                                          double iteration_seconds);

/* ---- Expert placement planner (moesnap/placement_planner.h) ------------------------------- */

/* A placement: experts[offsets[n] .. offsets[n + 1]) are node n's, for nodes n < node_count
 * (offsets has node_count + 1 entries, from 0). */
typedef struct moesnap_placement {
  const int32_t* experts;
  const size_t* offsets;
  size_t node_count;
} moesnap_placement;

/* AllocateReplicas, PlaceMaximumOverlap and PlaceSpread, RecoveryProbabilities of both and, with
 * failed nodes, Reconfigure, as JSON (release with moesnap_free): {"replicas": [...],
 * "placement": [[...] per node], "spread_placement": [[...]], "recovery": [{"failed", "overlap",
 * "overlap_interval": [low, high], "spread", "exact"}], "reconfiguration": null or as below}. */
MOESNAP_C_API moesnap_status moesnap_plan(const double* loads, size_t expert_count,
                                          int32_t nodes, int32_t slots, int32_t min_replicas,
                                          const int32_t* failed, size_t failed_count, char** json);
/* Reconfigure of `current` once `failed` nodes are gone, as JSON: {"survivors", "replicas",
 * "placement", "transfers": [{"expert", "from" (null: from the snapshot cluster), "to",
 * "bytes"}], "bytes_moved"}. `expert_bytes` has expert_count entries, or is NULL (1 each). */
MOESNAP_C_API moesnap_status moesnap_reconfigure(const double* loads, size_t expert_count,
                                                 int32_t nodes, int32_t slots,
                                                 int32_t min_replicas,
                                                 const moesnap_placement* current,
                                                 const int32_t* failed, size_t failed_count,
                                                 const uint64_t* expert_bytes, char** json);
/* RecoveryProbabilities as JSON: [{"failed", "probability", "interval": [low, high], "exact"}]. */
MOESNAP_C_API moesnap_status moesnap_recovery_probabilities(const moesnap_placement* placement,
                                                            int32_t experts, char** json);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* MOESNAP_CLIENT_MOESNAP_H_ */
