// What the durable tier uses of the store, and nothing else: the committed image of each step the
// node commits (to drain it to disk from the pool), and the load of a durable step back into the
// pool as a rank's committed state (a restore from disk then restores from memory, and the steps
// after it build on that state as on any committed one). The Store implements it; the durable
// tier's unit tests put a fake here. The durable tier calls down into the store; the store only
// tells the observer that a step committed, under its lock, and the observer only queues work.
#ifndef MOESNAP_DAEMON_DURABLE_STORE_H_
#define MOESNAP_DAEMON_DURABLE_STORE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/node_image.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

// Fills `out` with chunk `chunk` of region `region` (an index into the regions being loaded),
// its CRC-32C checked.
using ChunkSource = std::function<absl::Status(int region, uint32_t chunk, uint8_t* out)>;

// Every method is thread-safe.
class DurableStore {
 public:
  class CommitObserver {
   public:
    virtual ~CommitObserver() = default;
    // The node's committed step advanced from `previous` (absent: nothing committed before) to
    // `step`: in a cluster the step the cluster committed, on a single node the lowest latest
    // committed step of its ranks. Called under the store's lock, so it must only decide and
    // queue: `image()` returns the committed image with its pool extents held (they stay
    // allocated while the image lives, whatever commits next) and may be called during this call
    // only.
    virtual void Committed(std::optional<int64_t> previous, int64_t step,
                           const std::function<NodeImage()>& image) = 0;
  };

  virtual ~DurableStore() = default;

  // `observer` (null: none) must outlive the store or be replaced by null first.
  virtual void SetCommitObserver(CommitObserver* observer) = 0;
  // The committed image with its extents held, and each rank's record (latest committed step,
  // windows) in its `ranks`.
  virtual NodeImage CommittedImage() const = 0;
  // Makes `regions` (their bytes read by `read`) the committed state of `rank`, with `record` its
  // latest committed step and windows, in one journal write; the rank's earlier committed versions
  // are let go. Refused while the rank captures a step. In a cluster the node's record of the
  // committed step is dropped (the group's parity covers that step, not the loaded one), so the
  // next step the cluster commits is encoded whole.
  virtual absl::Status AdoptCommitted(uint32_t rank, const std::vector<v1::ImageRegion>& regions,
                                      const v1::JournalRank& record, const ChunkSource& read) = 0;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_DURABLE_STORE_H_
