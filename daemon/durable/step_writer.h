// Writes one committed node image from the pool to a step folder: each rank's regions into its
// data file (every chunk's CRC-32C checked against the capture's as it is written, so a corrupt
// pool is never made durable), then the manifest; files and folder synced, published by one
// rename. A failure (disk full, a directory that cannot be written) removes the partial folder and
// leaves every complete step as it was.
#ifndef MOESNAP_DAEMON_DURABLE_STEP_WRITER_H_
#define MOESNAP_DAEMON_DURABLE_STEP_WRITER_H_

#include <atomic>
#include <cstdint>

#include "absl/status/statusor.h"
#include "daemon/durable/clock.h"
#include "daemon/durable/durable_directory.h"
#include "daemon/node_image.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::durable {

// What a manifest records of the job the step belongs to.
struct StepIdentity {
  uint32_t node_id = 0;
  uint64_t cluster_digest = 0;  // 0 on a single node
  v1::ErasureShape shape;       // unset on a single node
  uint32_t cluster_nodes = 1;
};

struct WrittenStep {
  int64_t step = 0;
  uint64_t bytes = 0;  // data and manifest
  absl::Duration took;
};

struct WriteOptions {
  uint64_t bytes_per_second = 0;  // 0: no limit
};

// Writes `image` as step `step` of `directory`. `written` (may be null) counts the region bytes
// written so far; a set `stop` abandons the write (CANCELLED). Thread-compatible: one write per
// step at a time.
absl::StatusOr<WrittenStep> WriteStep(const DurableDirectory& directory, int64_t step,
                                      const NodeImage& image, const StepIdentity& identity,
                                      const WriteOptions& options, Clock* clock,
                                      std::atomic<uint64_t>* written,
                                      const std::atomic<bool>& stop);

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_STEP_WRITER_H_
