// The host copy backend: regions lie in memory the trainer handed over (TrainerSessions), mapped
// read-write once per file (restores write back into it); copies run with memcpy, a cache-sized
// piece at a time so the CRC reads bytes the copy just brought into cache.
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/copy_backend.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {
namespace {

constexpr uint64_t kPieceBytes = 256 * 1024;

class HostRegionSource : public RegionSource {
 public:
  HostRegionSource(std::shared_ptr<TrainerMemory> memory, uint64_t offset, uint64_t bytes)
      : memory_(std::move(memory)), offset_(offset), bytes_(bytes) {}
  uint64_t bytes() const override { return bytes_; }
  uint8_t* data() const { return memory_->data() + offset_; }

 private:
  std::shared_ptr<TrainerMemory> memory_;
  uint64_t offset_;
  uint64_t bytes_;
};

class HostCopyBackend : public CopyBackend {
 public:
  explicit HostCopyBackend(const TrainerSessions* sessions) : sessions_(sessions) {}

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
    return std::make_shared<HostRegionSource>(*std::move(memory), offset, spec.bytes());
  }

  absl::StatusOr<uint32_t> CopyOut(RegionSource& source, uint64_t offset, uint8_t* destination,
                                   uint64_t bytes, uint32_t crc) override {
    const uint8_t* origin = static_cast<HostRegionSource&>(source).data() + offset;
    for (uint64_t done = 0; done < bytes; done += kPieceBytes) {
      const uint64_t piece = std::min(kPieceBytes, bytes - done);
      std::memcpy(destination + done, origin + done, piece);
      crc = erasure::Crc32cExtend(crc, destination + done, piece);
    }
    return crc;
  }

  absl::StatusOr<uint32_t> CopyIn(RegionSource& source, uint64_t offset, const uint8_t* origin,
                                  uint64_t bytes, uint32_t crc) override {
    uint8_t* destination = static_cast<HostRegionSource&>(source).data() + offset;
    for (uint64_t done = 0; done < bytes; done += kPieceBytes) {
      const uint64_t piece = std::min(kPieceBytes, bytes - done);
      crc = erasure::Crc32cExtend(crc, origin + done, piece);
      std::memcpy(destination + done, origin + done, piece);
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
