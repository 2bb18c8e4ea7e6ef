// The host copy backend: regions lie in memory the trainer handed over (TrainerSessions), mapped
// read-write once per file (restores write back into it); each copy computes its CRC-32C in the
// same pass over memory (erasure::CopyWithCrc32c), guarded against the trainer's file shrinking.
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/bus_error_guard.h"
#include "daemon/copy_backend.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {
namespace {

// A trainer shrank its file under the copy (a page past its end raised SIGBUS).
absl::Status TruncatedError(uint32_t rank, uint64_t memory, uint64_t offset, uint64_t bytes) {
  return absl::FailedPreconditionError(absl::StrCat(
      "memory ", memory, " of rank ", rank, " was truncated under the copy (bus error in bytes [",
      offset, ", ", offset + bytes, ") of the file): a trainer keeps shared files at their size "
      "while regions in them are registered"));
}

class HostRegionSource : public RegionSource {
 public:
  HostRegionSource(std::shared_ptr<TrainerMemory> memory, uint32_t rank, uint64_t id,
                   uint64_t offset, uint64_t bytes)
      : memory_(std::move(memory)), rank_(rank), id_(id), offset_(offset), bytes_(bytes) {}
  uint64_t bytes() const override { return bytes_; }
  uint8_t* data() const { return memory_->data() + offset_; }
  // The error of a copy of `bytes` from `position` bytes into the region that found the file
  // shrunk.
  absl::Status Truncated(uint64_t position, uint64_t bytes) const {
    return TruncatedError(rank_, id_, offset_ + position, bytes);
  }

 private:
  std::shared_ptr<TrainerMemory> memory_;
  uint32_t rank_;
  uint64_t id_;
  uint64_t offset_;
  uint64_t bytes_;
};

uint8_t* RegionBytes(const Transfer& transfer) {
  return static_cast<const HostRegionSource&>(*transfer.source).data() + transfer.offset;
}

// A restored chunk of one transfer whose stored CRC-32C is known.
bool IsCheckedChunk(std::span<const Transfer> transfers, size_t index) {
  return transfers[index].expected && !transfers[index].continues && transfers[index].crc == 0 &&
         (index + 1 == transfers.size() || !transfers[index + 1].continues);
}

// `next` lies right after `previous` both in the trainer's memory and in the pool.
bool Follows(const Transfer& previous, const Transfer& next) {
  return RegionBytes(previous) + previous.bytes == RegionBytes(next) &&
         previous.host + previous.bytes == next.host;
}

// Copies `run` (checked chunks, each following the one before it) in one pass; true, with each
// chunk's `crc` set to its `expected`, when the run's CRC-32C is theirs joined. False when it is
// not or the copy met a bus error: the caller then copies each chunk alone to say which.
bool CopyRunChecked(std::span<Transfer> run) {
  uint64_t bytes = 0;
  uint32_t expected = 0;
  for (const Transfer& transfer : run) {
    bytes += transfer.bytes;
    expected = erasure::Crc32cCombine(expected, *transfer.expected, transfer.bytes);
  }
  uint32_t crc = 0;
  if (!GuardedCopyWithCrc32c(RegionBytes(run.front()), run.front().host, bytes, &crc) ||
      crc != expected) {
    return false;
  }
  for (Transfer& transfer : run) transfer.crc = *transfer.expected;
  return true;
}

class HostCopyBackend : public CopyBackend {
 public:
  explicit HostCopyBackend(const TrainerSessions* sessions) : sessions_(sessions) {
    InstallBusErrorGuard();
  }

  std::string name() const override { return "host"; }
  bool supports_device_memory() const override { return false; }

  absl::Status PinHostMemory(void* data, uint64_t bytes) override {
    if (mlock(data, bytes) != 0) {
      return absl::UnavailableError(absl::StrCat("mlock of ", bytes, " bytes failed: ",
                                                 std::strerror(errno),
                                                 " (raise LimitMEMLOCK / ulimit -l)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<RegionSource>> Open(uint32_t rank,
                                                     const v1::RegionSpec& spec) override {
    if (spec.device() != v1::DEVICE_HOST) {
      return absl::InvalidArgumentError(
          absl::StrCat("region '", spec.name(), "' is not host memory"));
    }
    absl::StatusOr<std::shared_ptr<TrainerMemory>> memory =
        sessions_->Find(rank, spec.handle().memory());
    if (!memory.ok()) {
      return absl::Status(memory.status().code(),
                          absl::StrCat("region '", spec.name(), "': ", memory.status().message()));
    }
    const uint64_t offset = spec.handle().shm_offset();
    if (offset > (*memory)->bytes() || spec.bytes() > (*memory)->bytes() - offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region '", spec.name(), "' is ", spec.bytes(), " bytes at offset ", offset,
          " but memory ", spec.handle().memory(), " of rank ", rank, " holds only ",
          (*memory)->bytes()));
    }
    return std::make_shared<HostRegionSource>(*std::move(memory), rank, spec.handle().memory(),
                                              offset, spec.bytes());
  }

  absl::StatusOr<uint32_t> CopyOut(RegionSource& source, uint64_t offset, uint8_t* destination,
                                   uint64_t bytes, uint32_t crc) override {
    const auto& region = static_cast<HostRegionSource&>(source);
    if (!GuardedCopyWithCrc32c(destination, region.data() + offset, bytes, &crc)) {
      return region.Truncated(offset, bytes);
    }
    return crc;
  }

  // Runs of restored chunks that lie one after another in the trainer's memory and in the pool
  // go as one copy (one pass at memcpy's speed instead of a short copy and CRC per chunk) checked
  // against their stored CRCs joined; every other transfer, and the chunks of a run whose check
  // fails, one by one (Transfer::expected).
  absl::Status CopyInBatch(std::span<Transfer> transfers) override {
    for (size_t first = 0; first < transfers.size();) {
      size_t end = first + 1;
      if (IsCheckedChunk(transfers, first)) {
        while (end < transfers.size() && IsCheckedChunk(transfers, end) &&
               Follows(transfers[end - 1], transfers[end])) {
          ++end;
        }
      }
      std::span<Transfer> run = transfers.subspan(first, end - first);
      if (run.size() < 2 || !CopyRunChecked(run)) {
        for (size_t i = first; i < end; ++i) {
          Transfer& transfer = transfers[i];
          absl::StatusOr<uint32_t> crc = CopyIn(*transfer.source, transfer.offset, transfer.host,
                                                transfer.bytes, CrcBefore(transfers, i));
          if (!crc.ok()) return crc.status();
          transfer.crc = *crc;
        }
      }
      first = end;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint32_t> CopyIn(RegionSource& source, uint64_t offset, const uint8_t* origin,
                                  uint64_t bytes, uint32_t crc) override {
    const auto& region = static_cast<HostRegionSource&>(source);
    if (!GuardedCopyWithCrc32c(region.data() + offset, origin, bytes, &crc)) {
      return region.Truncated(offset, bytes);
    }
    return crc;
  }

 private:
  const TrainerSessions* const sessions_;
};

}  // namespace

std::unique_ptr<CopyBackend> CreateHostCopyBackend(const TrainerSessions* sessions) {
  return std::make_unique<HostCopyBackend>(sessions);
}

}  // namespace moesnap::daemon
