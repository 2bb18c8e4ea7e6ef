// The host copy backend: regions are shared-memory files the trainer created; the daemon maps them
// read-write (restores write back into them) and copies with memcpy, a cache-sized piece at a time
// so the CRC reads bytes the copy just brought into cache.
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/shared_memory.h"
#include "daemon/copy_backend.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {
namespace {

constexpr uint64_t kPieceBytes = 256 * 1024;

class HostRegionSource : public RegionSource {
 public:
  HostRegionSource(SharedMemory memory, uint64_t offset, uint64_t bytes)
      : memory_(std::move(memory)), offset_(offset), bytes_(bytes) {}
  uint64_t bytes() const override { return bytes_; }
  uint8_t* data() const { return memory_.data() + offset_; }

 private:
  SharedMemory memory_;
  uint64_t offset_;
  uint64_t bytes_;
};

class HostCopyBackend : public CopyBackend {
 public:
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

  absl::StatusOr<std::shared_ptr<RegionSource>> Open(const v1::RegionSpec& spec) override {
    if (spec.device() != v1::DEVICE_HOST) {
      return absl::InvalidArgumentError(
          absl::StrCat("region '", spec.name(), "' is not host memory"));
    }
    absl::StatusOr<SharedMemory> memory = SharedMemory::Open(spec.handle().shm_name(), true);
    if (!memory.ok()) {
      return absl::Status(memory.status().code(),
                          absl::StrCat("region '", spec.name(), "': ", memory.status().message()));
    }
    const uint64_t end = spec.handle().shm_offset() + spec.bytes();
    if (end > memory->size() || end < spec.bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region '", spec.name(), "' is ", spec.bytes(), " bytes at offset ",
          spec.handle().shm_offset(), " but /dev/shm/", spec.handle().shm_name(), " holds only ",
          memory->size()));
    }
    return std::make_shared<HostRegionSource>(*std::move(memory), spec.handle().shm_offset(),
                                              spec.bytes());
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
};

}  // namespace

std::unique_ptr<CopyBackend> CreateHostCopyBackend() { return std::make_unique<HostCopyBackend>(); }

}  // namespace moesnap::daemon
