// Host memory a trainer shares with its node's moesnapd: an anonymous shared-memory file (memfd)
// mapped into the trainer. Tensors allocated here are snapshotted by the daemon with no copy
// through a socket, and restored by the daemon writing straight into them. The file has no name:
// the client hands its descriptor to the daemon (Client::RegisterHostRegion does), and the memory
// is gone when both let go of it, so a trainer that crashes leaves nothing behind.
//
// Ownership: a SharedBuffer owns its mapping and its descriptor. The file is sealed against
// shrinking, so the daemon can never fault reading it. Thread safety: the bytes are the caller's
// to synchronize; the object itself is immutable.
#ifndef MOESNAP_CLIENT_SHARED_BUFFER_H_
#define MOESNAP_CLIENT_SHARED_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace moesnap {

class SharedBuffer {
 public:
  static constexpr const char* kRegionFile = "moesnap-region";  // the files regions live in
  // Maps `bytes` of zeroed shared memory, reserved now (a full system is an error here, not a
  // fault on first write). `name` is the file's in /proc (memfd_create's), for whoever reads a
  // trainer's open files.
  static absl::StatusOr<std::shared_ptr<SharedBuffer>> Allocate(size_t bytes,
                                                                const char* name = kRegionFile);
  // Maps the whole of an existing shared-memory file of `bytes` bytes (one Client::AdoptMemory
  // handed back); owns `fd` once mapped (the caller keeps it on failure).
  static absl::StatusOr<std::shared_ptr<SharedBuffer>> Map(int fd, size_t bytes);
  // The same file, unmapped, for a caller that maps it itself (the Python package maps it with
  // mmap); the caller owns the descriptor.
  static absl::StatusOr<int> CreateFile(size_t bytes, const char* name = kRegionFile);
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  uint8_t* data() const;
  size_t size() const;
  // The file's descriptor, which registration hands to the daemon; owned by this object.
  int fd() const;

 private:
  struct State;
  explicit SharedBuffer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SHARED_BUFFER_H_
