// Pool: the arena file, and extents handed out by its ExtentAllocator.
#include "daemon/pool.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/byte_size.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {

PoolExtent::~PoolExtent() { pool_->Free(offset_, bytes_); }

uint8_t* PoolExtent::data() const { return pool_->base() + offset_; }

PoolBytes::PoolBytes(Extents extents, uint64_t bytes)
    : extents_(std::move(extents)), bytes_(bytes) {
  uint64_t start = 0;
  for (const std::shared_ptr<PoolExtent>& extent : extents_) {
    const uint64_t used = std::min(extent->bytes(), bytes_ - start);
    starts_.push_back(start);
    pieces_.push_back({extent->data(), used});
    start += used;
  }
}

PoolBytes PoolBytes::View(uint8_t* data, uint64_t bytes) {
  PoolBytes view;
  view.bytes_ = bytes;
  view.starts_.push_back(0);
  view.pieces_.push_back({data, bytes});
  return view;
}

void PoolBytes::Read(uint64_t offset, uint64_t length, uint8_t* out) const {
  ForEach(offset, length, [out](const uint8_t* data, uint64_t bytes, uint64_t position) {
    std::memcpy(out + position, data, bytes);
  });
}

void PoolBytes::Write(uint64_t offset, const uint8_t* in, uint64_t length) const {
  ForEach(offset, length, [in](uint8_t* data, uint64_t bytes, uint64_t position) {
    std::memcpy(data, in + position, bytes);
  });
}

uint32_t PoolBytes::Crc32c(uint64_t offset, uint64_t length) const {
  uint32_t crc = 0;
  ForEach(offset, length, [&crc](const uint8_t* data, uint64_t bytes, uint64_t) {
    crc = erasure::Crc32cExtend(crc, data, bytes);
  });
  return crc;
}

uint8_t* PoolBytes::Contiguous(uint64_t offset, uint64_t length) const {
  uint8_t* whole = nullptr;
  ForEach(offset, length, [&whole, length](uint8_t* data, uint64_t bytes, uint64_t position) {
    if (position == 0 && bytes == length) whole = data;
  });
  return whole;
}

Pool::Pool(SharedMemory memory, bool reattached, int lock_fd)
    : memory_(std::move(memory)), reattached_(reattached), lock_fd_(lock_fd),
      allocator_(memory_.size()) {}

absl::StatusOr<std::unique_ptr<Pool>> Pool::OpenOrCreate(const PoolOptions& options) {
  if (options.bytes < kPageBytes || options.bytes % kPageBytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat("pool.bytes must be a positive multiple of ",
                                                   kPageBytes, ", got ", options.bytes));
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
    memory = SharedMemory::Create(name, options.bytes, {.reserve = true});
  }
  if (!memory.ok()) return memory.status();
  const std::string path = absl::StrCat("/dev/shm/", name);
  const int lock_fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
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

absl::Status Pool::Exhausted(uint64_t bytes, const char* how) const {
  const uint64_t free = allocator_.free_bytes();
  // What the allocator needed: the request rounded up to the alignment (unless it is beyond any).
  bytes = ExtentAllocator::RoundUp(bytes, std::numeric_limits<uint64_t>::max()).value_or(bytes);
  return absl::ResourceExhaustedError(absl::StrCat(
      "the pool has ", free, " bytes free of ", capacity(), " (pool.bytes) but ", bytes, how,
      " bytes are needed", bytes > free ? absl::StrCat(": ", bytes - free, " more") : ""));
}

absl::StatusOr<std::shared_ptr<PoolExtent>> Pool::Allocate(uint64_t bytes) {
  absl::MutexLock lock(&mutex_);
  std::optional<ExtentAllocator::Range> range = allocator_.AllocateContiguous(bytes);
  if (!range) return Exhausted(bytes, " contiguous");
  return std::make_shared<PoolExtent>(this, range->offset, range->bytes);
}

absl::StatusOr<std::shared_ptr<PoolBytes>> Pool::AllocateBytes(uint64_t bytes) {
  std::vector<ExtentAllocator::Range> ranges;
  {
    absl::MutexLock lock(&mutex_);
    ranges = allocator_.AllocatePieces(bytes);
    if (ranges.empty()) return Exhausted(bytes, "");
  }
  PoolBytes::Extents extents;
  for (const ExtentAllocator::Range& range : ranges) {
    extents.push_back(std::make_shared<PoolExtent>(this, range.offset, range.bytes));
  }
  return std::make_shared<PoolBytes>(std::move(extents), bytes);
}

absl::StatusOr<std::shared_ptr<const PoolReservation>> Pool::Reserve(uint64_t bytes) {
  std::vector<ExtentAllocator::Range> ranges;
  {
    absl::MutexLock lock(&mutex_);
    ranges = allocator_.AllocatePieces(bytes);
    if (ranges.empty()) return Exhausted(bytes, "");
  }
  return std::shared_ptr<const PoolReservation>(new PoolReservation(this, std::move(ranges), bytes));
}

PoolReservation::PoolReservation(Pool* pool, std::vector<ExtentAllocator::Range> ranges,
                                 uint64_t bytes)
    : pool_(pool), ranges_(std::move(ranges)), bytes_(bytes) {
  uint64_t start = 0;
  for (const ExtentAllocator::Range& range : ranges_) {
    starts_.push_back(start);
    start += range.bytes;
  }
}

PoolReservation::~PoolReservation() {
  std::vector<ExtentAllocator::Range> taken;
  {
    absl::MutexLock lock(&mutex_);
    taken = std::move(taken_);
  }
  std::sort(taken.begin(), taken.end(),
            [](const auto& a, const auto& b) { return a.offset < b.offset; });
  // The gaps between the parts taken, in the reservation's own offsets, each freed range by range.
  const uint64_t end = starts_.empty() ? 0 : starts_.back() + ranges_.back().bytes;
  uint64_t position = 0;
  for (size_t part = 0; part <= taken.size(); ++part) {
    const uint64_t gap_end = part < taken.size() ? taken[part].offset : end;
    ForEachRange(position, gap_end - position, [this](uint64_t offset, uint64_t bytes) {
      pool_->Free(offset, bytes);
    });
    if (part < taken.size()) position = taken[part].offset + taken[part].bytes;
  }
}

template <typename Visit>
void PoolReservation::ForEachRange(uint64_t offset, uint64_t length, Visit visit) const {
  if (length == 0) return;
  size_t i = std::upper_bound(starts_.begin(), starts_.end(), offset) - starts_.begin() - 1;
  for (uint64_t done = 0; done < length; ++i) {
    const uint64_t within = offset + done - starts_[i];
    const uint64_t piece = std::min(length - done, ranges_[i].bytes - within);
    visit(ranges_[i].offset + within, piece);
    done += piece;
  }
}

uint64_t PoolReservation::SpaceFor(uint64_t bytes) {
  // Beyond any pool when rounding would wrap: the reservation is refused.
  return ExtentAllocator::RoundUp(bytes, std::numeric_limits<uint64_t>::max())
      .value_or(std::numeric_limits<uint64_t>::max());
}

std::shared_ptr<PoolBytes> PoolReservation::Take(uint64_t offset, uint64_t bytes) const {
  const uint64_t space = SpaceFor(bytes);
  {
    absl::MutexLock lock(&mutex_);
    // Contiguous parts merge, so a step's record of what was taken stays short.
    if (!taken_.empty() && taken_.back().offset + taken_.back().bytes == offset) {
      taken_.back().bytes += space;
    } else {
      taken_.push_back({offset, space});
    }
  }
  PoolBytes::Extents extents;
  ForEachRange(offset, space, [&](uint64_t at, uint64_t length) {
    extents.push_back(std::make_shared<PoolExtent>(pool_, at, length));
  });
  return std::make_shared<PoolBytes>(std::move(extents), bytes);
}

absl::StatusOr<std::shared_ptr<PoolExtent>> Pool::Claim(uint64_t offset, uint64_t bytes) {
  absl::MutexLock lock(&mutex_);
  const std::optional<uint64_t> needed = ExtentAllocator::RoundUp(bytes, capacity());
  if (!needed || !allocator_.Claim({offset, *needed})) {
    return absl::DataLossError(absl::StrCat("pool range [", offset, ", +", bytes,
                                            ") is not free, not aligned, or past the end of the "
                                            "pool"));
  }
  return std::make_shared<PoolExtent>(this, offset, *needed);
}

absl::StatusOr<std::shared_ptr<PoolBytes>> Pool::ClaimBytes(
    const std::vector<ExtentAllocator::Range>& ranges, uint64_t bytes) {
  PoolBytes::Extents extents;
  uint64_t held = 0;
  for (const ExtentAllocator::Range& range : ranges) {
    absl::StatusOr<std::shared_ptr<PoolExtent>> extent = Claim(range.offset, range.bytes);
    if (!extent.ok()) return extent.status();  // those claimed so far are freed with `extents`
    held += (*extent)->bytes();
    extents.push_back(*std::move(extent));
  }
  const uint64_t last = extents.empty() ? 0 : extents.back()->bytes();
  if (held < bytes || (bytes > 0 && held - last >= bytes)) {
    return absl::DataLossError(absl::StrCat(ranges.size(), " pool extents of ", held,
                                            " bytes in all cannot hold exactly ", bytes,
                                            " bytes, each used whole but the last"));
  }
  return std::make_shared<PoolBytes>(std::move(extents), bytes);
}

void Pool::Free(uint64_t offset, uint64_t bytes) {
  absl::MutexLock lock(&mutex_);
  allocator_.Free({offset, bytes});
}

uint64_t Pool::free_bytes() const {
  absl::MutexLock lock(&mutex_);
  return allocator_.free_bytes();
}

}  // namespace moesnap::daemon
