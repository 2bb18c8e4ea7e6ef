// The trainer's side of the memory handoff (common/memory_handoff_wire.h): a connection to the
// daemon's memory socket that hands file descriptors over, in batches, for one session.
#ifndef MOESNAP_CLIENT_SRC_MEMORY_CHANNEL_H_
#define MOESNAP_CLIENT_SRC_MEMORY_CHANNEL_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moesnap {

// Move-only; not thread-safe (the Client serializes its use).
class MemoryChannel {
 public:
  MemoryChannel() = default;
  static absl::StatusOr<MemoryChannel> Connect(const std::string& path, const std::string& session,
                                               std::chrono::milliseconds timeout);
  MemoryChannel(MemoryChannel&& other) noexcept;
  MemoryChannel& operator=(MemoryChannel&& other) noexcept;
  ~MemoryChannel();

  // Hands `fds` over (the caller keeps them); returns the daemon's id of each, in order.
  absl::StatusOr<std::vector<uint64_t>> Share(const std::vector<int>& fds);
  // A file the daemon kept from an exited process of this rank.
  struct Adopted {
    int fd = -1;      // owned by the caller
    uint64_t id = 0;  // the daemon's id of it in this session, as Share returns
  };
  // Asks for a file holding `bytes` bytes (memory_handoff::FileBytesFor) that an exited process of
  // this rank left with the daemon (its bytes are that process's, not zeros); nullopt when there is
  // none to be had.
  absl::StatusOr<std::optional<Adopted>> Adopt(uint64_t bytes);
  // True when the daemon's end of the connection is gone: the daemon that holds this session's
  // memory exited (or never connected).
  bool PeerClosed() const;

 private:
  MemoryChannel(int fd, std::string path, std::string session, std::chrono::milliseconds timeout)
      : fd_(fd), path_(std::move(path)), session_(std::move(session)), timeout_(timeout) {}
  absl::StatusOr<uint64_t> ShareBatch(const int* fds, uint32_t count);
  // Sends `request` with `count` descriptors attached and waits for the answer: its first_id, and
  // in `received` (when not null) a descriptor attached to it, or -1.
  absl::StatusOr<uint64_t> Exchange(const void* request, size_t request_bytes, const int* fds,
                                    uint32_t count, int* received);

  int fd_ = -1;
  std::string path_;
  std::string session_;
  std::chrono::milliseconds timeout_{0};
};

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SRC_MEMORY_CHANNEL_H_
