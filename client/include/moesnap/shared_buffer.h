// Host memory a trainer shares with its node's moesnapd: a named shared-memory file mapped into the
// trainer. Tensors allocated here are snapshotted by the daemon with no copy through a socket, and
// restored by the daemon writing straight into them.
//
// Ownership: a SharedBuffer owns its mapping and its file; destroying it unmaps and removes the file
// (the daemon keeps its own mapping while it needs one). A trainer that crashes leaves the file
// behind; moesnapd removes files of dead trainers when their rank reconnects or the daemon starts.
// Thread safety: the bytes are the caller's to synchronize; the object itself is immutable.
#ifndef MOESNAP_CLIENT_SHARED_BUFFER_H_
#define MOESNAP_CLIENT_SHARED_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace moesnap {

class SharedBuffer {
 public:
  // Maps `bytes` of zeroed shared memory, in a file readable and writable by the caller and, when
  // `group` is not empty, by that group (the daemon's, from Client::shm_group()).
  static absl::StatusOr<std::shared_ptr<SharedBuffer>> Allocate(size_t bytes,
                                                                const std::string& group = "");
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  uint8_t* data() const;
  size_t size() const;
  // The shared-memory file's name (under /dev/shm), which registration hands to the daemon.
  const std::string& name() const;

 private:
  struct State;
  explicit SharedBuffer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SHARED_BUFFER_H_
