// The trainer's side of the memory handoff (common/memory_handoff_wire.h): a connection to the
// daemon's memory socket that hands file descriptors over, in batches, for one session.
#ifndef MOESNAP_CLIENT_SRC_MEMORY_CHANNEL_H_
#define MOESNAP_CLIENT_SRC_MEMORY_CHANNEL_H_

#include <chrono>
#include <cstdint>
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
  // True when the daemon's end of the connection is gone: the daemon that holds this session's
  // memory exited (or never connected).
  bool PeerClosed() const;

 private:
  MemoryChannel(int fd, std::string path, std::string session, std::chrono::milliseconds timeout)
      : fd_(fd), path_(std::move(path)), session_(std::move(session)), timeout_(timeout) {}
  absl::StatusOr<uint64_t> ShareBatch(const int* fds, uint32_t count);

  int fd_ = -1;
  std::string path_;
  std::string session_;
  std::chrono::milliseconds timeout_{0};
};

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SRC_MEMORY_CHANNEL_H_
