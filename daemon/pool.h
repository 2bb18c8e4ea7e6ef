// The snapshot pool: one arena of host memory in a named shared-memory file, so that a restarted
// daemon finds every committed snapshot where it left it. Space is handed out as extents; an extent
// frees itself when its last holder lets go, so a restore reading a version can never see its bytes
// reused by a concurrent commit.
#ifndef MOESNAP_DAEMON_POOL_H_
#define MOESNAP_DAEMON_POOL_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/shared_memory.h"

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
  uint64_t bytes() const { return bytes_; }
  uint8_t* data() const;

 private:
  Pool* pool_;
  uint64_t offset_;
  uint64_t bytes_;
};

// Thread-safe. The pool must outlive every extent it handed out.
class Pool {
 public:
  // Extents start on this boundary so that copies and SIMD CRC loops run on aligned memory.
  static constexpr uint64_t kAlignment = 4096;

  // Maps /dev/shm/<name>.data, creating it (mode 0600, or 0660 for `group`) if absent. An existing
  // file of another size is an error naming both sizes: a pool is never silently resized.
  // The pool is locked (flock) for this process's lifetime: a second daemon on the same pool is
  // refused, and the kernel drops the lock when this one dies, however it dies.
  static absl::StatusOr<std::unique_ptr<Pool>> OpenOrCreate(const PoolOptions& options,
                                                            std::optional<gid_t> group);
  ~Pool();

  // Hands out `bytes` (rounded up to kAlignment). RESOURCE_EXHAUSTED says how much is free.
  absl::StatusOr<std::shared_ptr<PoolExtent>> Allocate(uint64_t bytes);
  // Claims a specific range at start-up, for a version found in the journal.
  absl::StatusOr<std::shared_ptr<PoolExtent>> Claim(uint64_t offset, uint64_t bytes);

  uint8_t* base() const { return memory_.data(); }
  uint64_t capacity() const { return memory_.size(); }
  uint64_t free_bytes() const;
  bool reattached() const { return reattached_; }
  const std::string& file_name() const { return memory_.name(); }

 private:
  friend class PoolExtent;
  Pool(SharedMemory memory, bool reattached, int lock_fd);
  void Free(uint64_t offset, uint64_t bytes);

  SharedMemory memory_;
  const bool reattached_;
  const int lock_fd_;
  mutable absl::Mutex mutex_;
  std::map<uint64_t, uint64_t> free_ ABSL_GUARDED_BY(mutex_);  // offset -> length, coalesced
  uint64_t free_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_POOL_H_
