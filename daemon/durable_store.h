// What the durable tier uses of the store, and nothing else: the committed image of each step the
// node commits (to drain it to disk from the pool), the rank's registered regions, and the writes
// of a restore from disk. The Store implements it; the durable tier's unit tests put a fake here.
// The durable tier calls down into the store; the store only tells the observer that a step
// committed, under its lock, and the observer only queues work.
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

// Fills `out` with `length` bytes of a region starting at `offset` (within one chunk).
using ChunkReader = std::function<absl::Status(uint64_t offset, uint64_t length, uint8_t* out)>;

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
  // The regions the rank's current process registered.
  virtual std::vector<std::string> RegisteredRegions(uint32_t rank) const = 0;
  // Writes a stored region into the rank's registered region of the same name, chunk by chunk as
  // `read` supplies them, checking size, dtype, shape and every chunk's CRC-32C.
  virtual absl::Status WriteRegionFrom(uint32_t rank, const v1::ImageRegion& stored,
                                       const ChunkReader& read) = 0;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_DURABLE_STORE_H_
