// The snapshot pool: one arena of host memory in a named shared-memory file, so that a restarted
// daemon finds every committed snapshot where it left it. Space is handed out as extents; an extent
// frees itself when its last holder lets go, so a restore reading a version can never see its bytes
// reused by a concurrent commit. A stored version takes its bytes in one or more extents (PoolBytes),
// so free bytes that are not contiguous never refuse a snapshot that fits.
#ifndef MOESNAP_DAEMON_POOL_H_
#define MOESNAP_DAEMON_POOL_H_

#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/shared_memory.h"
#include "daemon/extent_allocator.h"

namespace moesnap::daemon {

enum class PoolLockMode {
  kAuto,      // page-lock if possible, warn if not
  kRequired,  // refuse to start unless page-locked
  kOff,
};

struct PoolOptions {
  std::string name = "moesnap";  // /dev/shm/<name>.data and /dev/shm/<name>.journal
  uint64_t bytes = uint64_t{8} << 30;
  PoolLockMode lock = PoolLockMode::kAuto;
  uint64_t journal_bytes = uint64_t{16} << 20;
};

class Pool;

// A range of the pool owned by one stored version. Destroying the last reference frees the range.
class PoolExtent {
 public:
  PoolExtent(Pool* pool, uint64_t offset, uint64_t bytes) : pool_(pool), offset_(offset), bytes_(bytes) {}
  ~PoolExtent();
  PoolExtent(const PoolExtent&) = delete;
  PoolExtent& operator=(const PoolExtent&) = delete;

  uint64_t offset() const { return offset_; }
  uint64_t bytes() const { return bytes_; }  // a multiple of ExtentAllocator::kAlignment
  uint8_t* data() const;

 private:
  Pool* pool_;
  uint64_t offset_;
  uint64_t bytes_;
};

// A byte string held in pieces, in order: a stored version's extents (every piece but the last is
// used whole), or a view of contiguous memory outside the pool that owns nothing. Immutable; the
// bytes are the caller's to synchronize.
class PoolBytes {
 public:
  struct Piece {
    uint8_t* data = nullptr;
    uint64_t bytes = 0;
  };

  // Most byte strings are one extent (a version cut from its step's reservation): kept inline, a
  // version costs no allocations for them.
  using Extents = absl::InlinedVector<std::shared_ptr<PoolExtent>, 1>;

  // `extents` hold `bytes` bytes: each extent whole, but the last, which holds the rest.
  PoolBytes(Extents extents, uint64_t bytes);
  static PoolBytes View(uint8_t* data, uint64_t bytes);

  uint64_t bytes() const { return bytes_; }
  const absl::InlinedVector<Piece, 1>& pieces() const { return pieces_; }
  const Extents& extents() const { return extents_; }

  // Calls visit(data, length, position) for the pieces of [offset, offset + length) in order;
  // `position` is where the piece starts within that range. The range must lie within bytes().
  template <typename Visit>
  void ForEach(uint64_t offset, uint64_t length, Visit visit) const;
  void Read(uint64_t offset, uint64_t length, uint8_t* out) const;
  void Write(uint64_t offset, const uint8_t* in, uint64_t length) const;
  // CRC-32C of [offset, offset + length).
  uint32_t Crc32c(uint64_t offset, uint64_t length) const;
  // The memory of [offset, offset + length) when it lies in one piece, else null: to be written in
  // place. The range must lie within bytes().
  uint8_t* Contiguous(uint64_t offset, uint64_t length) const;

 private:
  PoolBytes() = default;

  Extents extents_;
  absl::InlinedVector<Piece, 1> pieces_;
  absl::InlinedVector<uint64_t, 1> starts_;  // offset of each piece within the byte string
  uint64_t bytes_ = 0;
};

template <typename Visit>
void PoolBytes::ForEach(uint64_t offset, uint64_t length, Visit visit) const {
  const uint64_t end = offset + length;
  size_t i = std::upper_bound(starts_.begin(), starts_.end(), offset) - starts_.begin();
  i = i == 0 ? 0 : i - 1;
  for (; i < pieces_.size() && starts_[i] < end; ++i) {
    const uint64_t from = std::max(offset, starts_[i]);
    const uint64_t to = std::min(end, starts_[i] + pieces_[i].bytes);
    if (from < to) visit(pieces_[i].data + (from - starts_[i]), to - from, from - offset);
  }
}

// Space for the versions of one step, taken from the pool in one allocation (a few extents at
// most) and cut into the versions' byte strings by whoever copies them: a step of thousands of
// regions costs one allocation, not one each. Each part must be taken exactly once; what is taken
// belongs to the PoolBytes it became (freed with it), and what is never taken goes back to the
// pool with the reservation. Thread-safe.
class PoolReservation {
 public:
  ~PoolReservation();
  PoolReservation(const PoolReservation&) = delete;
  PoolReservation& operator=(const PoolReservation&) = delete;

  // The space a version of `bytes` bytes takes: rounded up to the pool's alignment (the largest
  // uint64_t when that would wrap, which no pool holds).
  static uint64_t SpaceFor(uint64_t bytes);
  uint64_t bytes() const { return bytes_; }
  // [offset, offset + SpaceFor(bytes)) of the reservation as a byte string of `bytes` bytes.
  // The range must lie within the reservation, start on the alignment and not be taken before.
  std::shared_ptr<PoolBytes> Take(uint64_t offset, uint64_t bytes) const;

 private:
  friend class Pool;
  PoolReservation(Pool* pool, std::vector<ExtentAllocator::Range> ranges, uint64_t bytes);
  // Calls visit(pool offset, bytes) for the pool ranges of [offset, offset + length) of the
  // reservation, in order.
  template <typename Visit>
  void ForEachRange(uint64_t offset, uint64_t length, Visit visit) const;

  Pool* const pool_;
  const std::vector<ExtentAllocator::Range> ranges_;  // in order
  std::vector<uint64_t> starts_;                      // where each range starts in the reservation
  const uint64_t bytes_;
  mutable absl::Mutex mutex_;
  mutable std::vector<ExtentAllocator::Range> taken_ ABSL_GUARDED_BY(mutex_);  // reservation offsets
};

// Thread-safe. The pool must outlive every extent it handed out.
class Pool {
 public:
  // The pool file's size is a whole number of pages.
  static constexpr uint64_t kPageBytes = 4096;

  // Maps /dev/shm/<name>.data, creating it (mode 0600: private to the daemon's user) if absent. An existing
  // file of another size is an error naming both sizes: a pool is never silently resized.
  // The pool is locked (flock) for this process's lifetime: a second daemon on the same pool is
  // refused, and the kernel drops the lock when this one dies, however it dies.
  static absl::StatusOr<std::unique_ptr<Pool>> OpenOrCreate(const PoolOptions& options);
  ~Pool();

  // Hands out `bytes` in one extent (rounded up to ExtentAllocator::kAlignment), for buffers that
  // must be contiguous. RESOURCE_EXHAUSTED says how much is free.
  absl::StatusOr<std::shared_ptr<PoolExtent>> Allocate(uint64_t bytes);
  // Hands out `bytes` in as few extents as the free space allows: refused only when fewer bytes
  // are free. RESOURCE_EXHAUSTED says how much is free.
  absl::StatusOr<std::shared_ptr<PoolBytes>> AllocateBytes(uint64_t bytes);
  // Hands out `bytes` (a sum of PoolReservation::SpaceFor) to be cut into versions later; refused
  // like AllocateBytes.
  absl::StatusOr<std::shared_ptr<const PoolReservation>> Reserve(uint64_t bytes);
  // Claims a specific range at start-up, for a version found in the journal.
  absl::StatusOr<std::shared_ptr<PoolExtent>> Claim(uint64_t offset, uint64_t bytes);
  // Claims the extents of a version found in the journal, holding `bytes` bytes.
  absl::StatusOr<std::shared_ptr<PoolBytes>> ClaimBytes(
      const std::vector<ExtentAllocator::Range>& extents, uint64_t bytes);

  uint8_t* base() const { return memory_.data(); }
  uint64_t capacity() const { return memory_.size(); }
  uint64_t free_bytes() const;
  bool reattached() const { return reattached_; }
  const std::string& file_name() const { return memory_.name(); }

 private:
  friend class PoolExtent;
  friend class PoolReservation;
  Pool(SharedMemory memory, bool reattached, int lock_fd);
  void Free(uint64_t offset, uint64_t bytes);
  absl::Status Exhausted(uint64_t bytes, const char* how) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  SharedMemory memory_;
  const bool reattached_;
  const int lock_fd_;
  mutable absl::Mutex mutex_;
  ExtentAllocator allocator_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_POOL_H_
