// The host copy backend: regions lie in memory the trainer handed over (TrainerSessions), mapped
// read-write once per file (restores write back into it); each copy computes its CRC-32C in the
// same pass over memory (erasure::CopyWithCrc32c), guarded against the trainer's file shrinking.
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/bus_error_guard.h"
#include "daemon/copy_backend.h"

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
