// A rank's restore from a durable step: its regions read from the step's data files chunk by
// chunk, each chunk's CRC-32C checked, and written into the rank's registered regions.
#ifndef MOESNAP_DAEMON_DURABLE_DISK_RESTORE_H_
#define MOESNAP_DAEMON_DURABLE_DISK_RESTORE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/durable/step_reader.h"
#include "daemon/durable_store.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::durable {

// The rank's record in the step (its latest committed step and windows), if the step holds one.
std::optional<v1::JournalRank> RankRecord(const v1::DurableManifest& manifest, uint32_t rank);

// Restores `regions` of `rank` (every registered region when empty) from `step`. Every region
// must be in the step; the response's step is the rank's latest committed step as of the drained
// step, its tier TIER_DURABLE.
absl::StatusOr<v1::RestoreResponse> RestoreFromDisk(DurableStore* store, const StepReader& step,
                                                    uint32_t rank,
                                                    const std::vector<std::string>& regions);

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_DISK_RESTORE_H_
