// Named POSIX shared-memory files (/dev/shm/<name>), mapped into this process. The daemon keeps its
// snapshot pool and journal in them so that they outlive the daemon process.
#ifndef MOESNAP_COMMON_SHARED_MEMORY_H_
#define MOESNAP_COMMON_SHARED_MEMORY_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moesnap {

// One mapping of a named shared-memory file, with its page tables filled at map time (MAP_POPULATE):
// first-touch page faults cost about 10 us each on virtual machines, which made a 256 MiB restore
// into freshly mapped memory take 0.7 s instead of tens of milliseconds. Where the hypervisor
// shadows the guest's page tables, the first access to each page of a new mapping still costs
// about half of that (bench/RESULTS.md): mappings are kept, not made again. Move-only; unmaps on
// destruction (the file stays until Unlink). Not thread-safe to move; the mapped bytes are the
// caller's to synchronize.
class SharedMemory {
 public:
  struct CreateOptions {
    // Reserve the memory now (posix_fallocate), so that a full /dev/shm is an error here rather than
    // a SIGBUS on first write.
    bool reserve = true;
  };

  // Creates the file exclusively (ALREADY_EXISTS if it exists), mode 0600 (private to this user),
  // with `bytes` bytes, and maps it.
  static absl::StatusOr<SharedMemory> Create(const std::string& name, size_t bytes,
                                             const CreateOptions& options);
  // Maps an existing file whole (NOT_FOUND if absent). Only a file this process could have created:
  // a regular file (not a symlink) owned by this process's uid with mode 0600; anything else may
  // have been planted or read by another user, and is FAILED_PRECONDITION naming owner and mode.
  static absl::StatusOr<SharedMemory> Open(const std::string& name, bool writable);
  // Removes the name; existing mappings stay valid. NOT_FOUND if absent.
  static absl::Status Unlink(const std::string& name);
  static bool Exists(const std::string& name);

  SharedMemory(SharedMemory&& other) noexcept;
  SharedMemory& operator=(SharedMemory&& other) noexcept;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  ~SharedMemory();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  SharedMemory(std::string name, uint8_t* data, size_t size)
      : name_(std::move(name)), data_(data), size_(size) {}
  void Release();

  std::string name_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};


}  // namespace moesnap

#endif  // MOESNAP_COMMON_SHARED_MEMORY_H_
