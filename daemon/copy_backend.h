// How the daemon reads a trainer's region and writes it back: one interface, one backend per kind of
// memory (host shared memory; CUDA IPC). The store never knows which backend it talks to.
#ifndef MOESNAP_DAEMON_COPY_BACKEND_H_
#define MOESNAP_DAEMON_COPY_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/trainer_memory.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

// A trainer's region as opened by a backend (a mapping, an opened IPC handle). Held by every copy in
// flight, so that a trainer re-registering never unmaps memory a copy is reading.
class RegionSource {
 public:
  virtual ~RegionSource() = default;
  virtual uint64_t bytes() const = 0;
};

// One copy of a batch: `bytes` (more than 0) at `offset` of a region's source, to or from `host`
// (pool memory). A transfer that `continues` the one before it in the batch (the next pool extent
// of the same chunk) extends that one's CRC-32C; any other extends `crc` as given (0 at a chunk's
// start). The copy sets `crc` to the CRC through this transfer.
// A restore's chunk that is one transfer carries `expected`, the CRC-32C stored for it. A backend
// may then copy a run of such chunks that lie one after another both in the region's memory and in
// the pool in one pass, and check the run's CRC against theirs joined (erasure::Crc32cCombine):
// when they agree each `crc` is set to its `expected`; when they do not, each chunk is copied again
// alone and its own CRC set, so that the caller names the chunks that differ.
struct Transfer {
  RegionSource* source = nullptr;
  uint64_t offset = 0;
  uint8_t* host = nullptr;
  uint64_t bytes = 0;
  bool continues = false;
  uint32_t crc = 0;
  std::optional<uint32_t> expected = std::nullopt;
};

// The CRC-32C that transfer `index` of a batch extends: the one before it has set its own by then.
inline uint32_t CrcBefore(std::span<const Transfer> transfers, size_t index) {
  return transfers[index].continues && index > 0 ? transfers[index - 1].crc : transfers[index].crc;
}

// Thread-safe: copies of different chunks run concurrently on the capture threads.
class CopyBackend {
 public:
  virtual ~CopyBackend() = default;
  virtual std::string name() const = 0;
  virtual bool supports_device_memory() const = 0;

  // Page-locks daemon memory (the pool) so copies run at full speed and it is never swapped.
  virtual absl::Status PinHostMemory(void* data, uint64_t bytes) = 0;

  // Opens the region trainer rank `rank` registered. INVALID_ARGUMENT/NOT_FOUND/PERMISSION_DENIED
  // name it.
  virtual absl::StatusOr<std::shared_ptr<RegionSource>> Open(uint32_t rank,
                                                             const v1::RegionSpec& spec) = 0;

  // Copies region bytes [offset, offset + bytes) to `destination` and returns the CRC-32C of the
  // bytes as written there, extended from `crc` (the CRC of the chunk's bytes before them, 0 at
  // its start): a trainer writing the region under the copy never yields a CRC of other bytes.
  // Waits first for the trainer's capture event, if any.
  virtual absl::StatusOr<uint32_t> CopyOut(RegionSource& source, uint64_t offset,
                                           uint8_t* destination, uint64_t bytes, uint32_t crc) = 0;

  // Copies `bytes` from `origin` into the region at `offset`, returning the CRC-32C of the bytes read
  // from `origin` extended from `crc`, so that a restore checks what it wrote against the stored
  // checksums.
  virtual absl::StatusOr<uint32_t> CopyIn(RegionSource& source, uint64_t offset,
                                          const uint8_t* origin, uint64_t bytes, uint32_t crc) = 0;

  // CopyOut and CopyIn of every transfer of a batch (a run of small regions, or the extents of one
  // chunk), each transfer's CRC-32C set as they return it; a backend whose copies wait on a device
  // queues them all and waits once. The first failure ends the batch.
  virtual absl::Status CopyOutBatch(std::span<Transfer> transfers);
  virtual absl::Status CopyInBatch(std::span<Transfer> transfers);
};

// Host regions in memory trainers handed over (found in `sessions`); page-locks with mlock.
std::unique_ptr<CopyBackend> CreateHostCopyBackend(const TrainerSessions* sessions);

// GPU regions by CUDA IPC into pinned memory; page-locks with cudaHostRegister. UNAVAILABLE when the
// build has no CUDA, or no driver or device is present (then the daemon serves host regions only).
absl::StatusOr<std::unique_ptr<CopyBackend>> CreateCudaCopyBackend();

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_COPY_BACKEND_H_
