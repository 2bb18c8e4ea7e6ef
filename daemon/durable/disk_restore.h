// A rank's state loaded from a durable step back into memory: its regions read from the step's
// data files chunk by chunk, each chunk's CRC-32C checked, and adopted by the store as the rank's
// committed state. The trainer then restores from memory as always, and the steps it snapshots
// next build on that state like on any committed one (a step capturing a subset of regions keeps
// the loaded versions of the others).
#ifndef MOESNAP_DAEMON_DURABLE_DISK_RESTORE_H_
#define MOESNAP_DAEMON_DURABLE_DISK_RESTORE_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "daemon/durable/step_reader.h"
#include "daemon/durable_store.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::durable {

// The rank's record in the step (its latest committed step and windows), if the step holds one.
std::optional<v1::JournalRank> RankRecord(const v1::DurableManifest& manifest, uint32_t rank);

// Loads every region of `rank` in `step` into the store as the rank's committed state. NOT_FOUND
// when the step holds nothing of the rank.
absl::Status LoadRankFromDisk(DurableStore* store, const StepReader& step, uint32_t rank);

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_DISK_RESTORE_H_
