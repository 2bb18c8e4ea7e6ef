// Checks of what a trainer (Agent service) or an operator (Admin service) sends, before a handler
// acts on it: every field of every request that carries one, against bounds that hold whatever the
// daemon's state. Each check bounds what is allocated, looped over, kept in the journal or
// computed with, and is overflow-safe; an error is INVALID_ARGUMENT naming the field, what was
// expected and what was found. What only the store can judge (a step against the rank's latest, a
// region name against its registrations, a sparse slot against the open window, a region against
// the memory handed over) is checked by the store and the copy backends.
//
// Requests that carry nothing to check are not listed: Hello, LatestCommitted, RestoreTier and
// DropRank carry a rank, any number of which is valid (the Agent's session binding and the store's
// records decide), and Status, ListSteps, ListWindows, ClusterStatus and ListDurable carry nothing
// or an optional rank. Rebuild's node id is the cluster's to judge against its node table.
#ifndef MOESNAP_DAEMON_REQUEST_CHECKS_H_
#define MOESNAP_DAEMON_REQUEST_CHECKS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

// Steps are 0 to 2^62: beyond any training run (a step per microsecond for 146,000 years), with
// room for the arithmetic done on them (a window's first step plus a slot, the step after one).
inline constexpr int64_t kMaxStep = int64_t{1} << 62;
// No machine's memory holds a larger region; with kMaxRegionsPerRegistration of them, the sizes of
// one registration add up without overflow.
inline constexpr uint64_t kMaxRegionBytes = uint64_t{1} << 46;
// The client registers 8192 regions per call; a registration opens and plans each one.
inline constexpr int kMaxRegionsPerRegistration = 1 << 16;
// Region names a Snapshot or Restore selects, and operators a sparse slot lists (kept in the
// journal with the slot).
inline constexpr int kMaxNamesPerRequest = 1 << 20;
inline constexpr int kMaxOperatorsPerSlot = 1 << 16;
// A sparse window's alias sets: the trainer writes one while the other holds the last committed
// window.
inline constexpr uint32_t kSparseBuffers = 2;
// cudaIpcMemHandle_t and cudaIpcEventHandle_t (CUDA_IPC_HANDLE_SIZE).
inline constexpr size_t kCudaIpcHandleBytes = 64;

// Agent.
// Each region bounded (region_limits.h), of a known device with a handle of that device's shape,
// at most kMaxRegionBytes, a shape of no negative dimension, a valid replica group that includes
// the rank; names unique within the request; at most kMaxRegionsPerRegistration regions.
absl::Status CheckRegisterRegions(const v1::RegisterRegionsRequest& request);
// The step bounded, the names selected bounded; a sparse slot inside its window (slot below the
// window's size, window_first_step + slot = step), in one of the kSparseBuffers buffers, with
// bounded operator names.
absl::Status CheckSnapshot(const v1::SnapshotRequest& request);
// WaitCaptured and WaitCommitted.
absl::Status CheckWait(const v1::WaitRequest& request);
// The step (if given) bounded, the names bounded; a restore from another rank takes no step.
absl::Status CheckRestore(const v1::RestoreRequest& request);
// A record with a direction, of a bounded step, sent to another rank.
absl::Status CheckAppendLog(const v1::AppendLogRequest& request);
absl::Status CheckFetchLog(const v1::FetchLogRequest& request);

// Admin.
absl::Status CheckInspectStep(const v1::InspectStepRequest& request);
absl::Status CheckDropStep(const v1::DropStepRequest& request);
absl::Status CheckVerify(const v1::VerifyRequest& request);
// The step (if given) bounded, the tier one of Tier's values.
absl::Status CheckExport(const v1::ExportRequest& request);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_REQUEST_CHECKS_H_
