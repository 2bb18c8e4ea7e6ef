// Pool: first-fit extent allocation over the shared-memory arena, with coalescing frees.
#include "daemon/pool.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/byte_size.h"

namespace moesnap::daemon {
namespace {
uint64_t RoundUp(uint64_t bytes) { return (bytes + Pool::kAlignment - 1) / Pool::kAlignment * Pool::kAlignment; }
}  // namespace

PoolExtent::~PoolExtent() { pool_->Free(offset_, bytes_); }

uint8_t* PoolExtent::data() const { return pool_->base() + offset_; }

Pool::Pool(SharedMemory memory, bool reattached, int lock_fd)
    : memory_(std::move(memory)), reattached_(reattached), lock_fd_(lock_fd) {
  absl::MutexLock lock(&mutex_);
  free_[0] = memory_.size();
  free_bytes_ = memory_.size();
}

absl::StatusOr<std::unique_ptr<Pool>> Pool::OpenOrCreate(const PoolOptions& options,
                                                         std::optional<gid_t> group) {
  if (options.bytes < kAlignment || options.bytes % kAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("pool.bytes must be a positive multiple of ",
                                                   kAlignment, ", got ", options.bytes));
  }
  const std::string name = options.name + ".data";
  absl::StatusOr<SharedMemory> memory = SharedMemory::Open(name, /*writable=*/true);
  bool reattached = memory.ok();
  if (memory.ok() && memory->size() != options.bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the pool /dev/shm/", name, " holds ", memory->size(), " bytes (",
        FormatByteSize(memory->size()), ") but pool.bytes is ", options.bytes, " (",
        FormatByteSize(options.bytes), "); set pool.bytes back, or remove the pool files (losing "
        "the snapshots in them) to change its size"));
  }
  if (absl::IsNotFound(memory.status())) {
    memory = SharedMemory::Create(name, options.bytes, {.group = group, .reserve = true});
  }
  if (!memory.ok()) return memory.status();
  const std::string path = absl::StrCat("/dev/shm/", name);
  const int lock_fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (lock_fd < 0 || flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    if (lock_fd >= 0) close(lock_fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "the pool ", path, " is in use by another moesnapd (", std::strerror(error),
        "); one daemon per pool"));
  }
  return std::unique_ptr<Pool>(new Pool(*std::move(memory), reattached, lock_fd));
}

Pool::~Pool() { close(lock_fd_); }

absl::StatusOr<std::shared_ptr<PoolExtent>> Pool::Allocate(uint64_t bytes) {
  const uint64_t needed = RoundUp(bytes == 0 ? 1 : bytes);
  absl::MutexLock lock(&mutex_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < needed) continue;
    const uint64_t offset = it->first;
    const uint64_t remaining = it->second - needed;
    free_.erase(it);
    if (remaining > 0) free_[offset + needed] = remaining;
    free_bytes_ -= needed;
    return std::make_shared<PoolExtent>(this, offset, needed);
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the pool has ", free_bytes_, " bytes free of ", capacity(), " (pool.bytes) but ", needed,
      " contiguous bytes are needed", needed > free_bytes_ ? absl::StrCat(": ", needed - free_bytes_, " more") : ""));
}

absl::StatusOr<std::shared_ptr<PoolExtent>> Pool::Claim(uint64_t offset, uint64_t bytes) {
  const uint64_t needed = RoundUp(bytes == 0 ? 1 : bytes);
  absl::MutexLock lock(&mutex_);
  auto it = free_.upper_bound(offset);
  if (it == free_.begin() || offset % kAlignment != 0) {
    return absl::DataLossError(absl::StrCat("pool range [", offset, ", +", needed, ") is not free"));
  }
  --it;
  const uint64_t start = it->first, length = it->second;
  if (offset + needed > start + length) {
    return absl::DataLossError(absl::StrCat("pool range [", offset, ", +", needed,
                                            ") overlaps another version or the end of the pool"));
  }
  free_.erase(it);
  if (offset > start) free_[start] = offset - start;
  if (start + length > offset + needed) free_[offset + needed] = start + length - offset - needed;
  free_bytes_ -= needed;
  return std::make_shared<PoolExtent>(this, offset, needed);
}

void Pool::Free(uint64_t offset, uint64_t bytes) {
  absl::MutexLock lock(&mutex_);
  auto [it, inserted] = free_.emplace(offset, bytes);
  free_bytes_ += bytes;
  auto next = std::next(it);
  if (next != free_.end() && offset + bytes == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto previous = std::prev(it);
    if (previous->first + previous->second == offset) {
      previous->second += it->second;
      free_.erase(it);
    }
  }
}

uint64_t Pool::free_bytes() const {
  absl::MutexLock lock(&mutex_);
  return free_bytes_;
}

}  // namespace moesnap::daemon
