// MemoryChannel: SOCK_SEQPACKET with SCM_RIGHTS, every wait bounded by the call timeout.
#include "client/src/memory_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/descriptor_passing.h"
#include "common/memory_handoff_wire.h"

namespace moesnap {
namespace {

namespace wire = ::moesnap::memory_handoff;

}  // namespace

absl::StatusOr<MemoryChannel> MemoryChannel::Connect(const std::string& path,
                                                     const std::string& session,
                                                     std::chrono::milliseconds timeout) {
  if (session.size() != wire::kSessionBytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "moesnapd answered Hello without a session to hand memory over to (", session.size(),
        " bytes); is it an older daemon?"));
  }
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("memory socket path '", path, "' is not usable"));
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(): ", std::strerror(errno)));
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    const int error = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to moesnapd's memory socket ", path,
                                               ": ", std::strerror(error)));
  }
  MemoryChannel channel(fd, path, session, timeout);
  // Bound to the session at once: the daemon keeps the rank for this process while it is open.
  if (absl::StatusOr<uint64_t> bound = channel.ShareBatch(nullptr, 0); !bound.ok()) {
    return bound.status();
  }
  return channel;
}

MemoryChannel::MemoryChannel(MemoryChannel&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)),
      session_(std::move(other.session_)), timeout_(other.timeout_) {}

MemoryChannel& MemoryChannel::operator=(MemoryChannel&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    session_ = std::move(other.session_);
    timeout_ = other.timeout_;
  }
  return *this;
}

MemoryChannel::~MemoryChannel() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<std::vector<uint64_t>> MemoryChannel::Share(const std::vector<int>& fds) {
  std::vector<uint64_t> ids;
  ids.reserve(fds.size());
  for (size_t done = 0; done < fds.size(); done += wire::kMaxFilesPerRequest) {
    const auto count =
        static_cast<uint32_t>(std::min<size_t>(wire::kMaxFilesPerRequest, fds.size() - done));
    absl::StatusOr<uint64_t> first = ShareBatch(fds.data() + done, count);
    if (!first.ok()) return first.status();
    for (uint32_t i = 0; i < count; ++i) ids.push_back(*first + i);
  }
  return ids;
}

bool MemoryChannel::PeerClosed() const {
  if (fd_ < 0) return true;
  pollfd state{fd_, POLLIN | POLLRDHUP, 0};
  if (poll(&state, 1, 0) <= 0) return false;
  if ((state.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0) return true;
  char byte;  // the daemon sends nothing unasked: readable means end of file
  return recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

absl::StatusOr<uint64_t> MemoryChannel::ShareBatch(const int* fds, uint32_t count) {
  wire::Request request;
  request.files = count;
  std::memcpy(request.session, session_.data(), wire::kSessionBytes);
  return Exchange(&request, sizeof(request), fds, count, nullptr);
}

absl::StatusOr<std::optional<MemoryChannel::Adopted>> MemoryChannel::Adopt(uint64_t bytes) {
  wire::AdoptRequest request;
  request.bytes = bytes;
  std::memcpy(request.session, session_.data(), wire::kSessionBytes);
  int fd = -1;
  absl::StatusOr<uint64_t> id = Exchange(&request, sizeof(request), nullptr, 0, &fd);
  if (absl::IsNotFound(id.status())) return std::nullopt;
  if (!id.ok()) return id.status();
  if (fd < 0) {
    return absl::DataLossError(absl::StrCat("moesnapd at ", path_, " handed over memory ", *id,
                                            " without its descriptor"));
  }
  return Adopted{fd, *id};
}

absl::StatusOr<uint64_t> MemoryChannel::Exchange(const void* request, size_t request_bytes,
                                                 const int* fds, uint32_t count, int* received) {
  if (fd_ < 0) return absl::FailedPreconditionError("the memory channel is not connected");
  if (SendWithDescriptors(fd_, request, request_bytes, fds, count, MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request_bytes)) {
    return absl::UnavailableError(absl::StrCat("handing memory to moesnapd at ", path_,
                                               " failed: ", std::strerror(errno)));
  }
  pollfd ready{fd_, POLLIN, 0};
  const int polled = poll(&ready, 1, static_cast<int>(timeout_.count()));
  if (polled <= 0) {
    // A late answer would be read as the next request's: the channel is closed (the daemon ends
    // the session, and the client connects again at its next call).
    close(fd_);
    fd_ = -1;
    return absl::DeadlineExceededError(absl::StrCat(
        "moesnapd at ", path_, " did not answer a memory handoff within ", timeout_.count(), " ms"));
  }
  char packet[sizeof(wire::Response) + wire::kMaxMessageBytes];
  ReceivedMessage answer = ReceiveWithDescriptors(fd_, packet, sizeof(packet), 0);
  const ssize_t got = answer.bytes;
  // Every descriptor the daemon attached is taken: the one asked for, the rest closed.
  int attached = -1;
  for (int file : answer.descriptors) {
    if (attached < 0 && received != nullptr) {
      attached = file;
    } else {
      close(file);
    }
  }
  auto refuse = [&attached](absl::Status status) {
    if (attached >= 0) close(attached);
    return status;
  };
  if (got >= 0 && answer.truncated) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(
        "the descriptor moesnapd at ", path_, " handed over was lost: this process has no free "
        "descriptor (raise the open-file limit, ulimit -n)")));
  }
  wire::Response response;
  if (got < static_cast<ssize_t>(sizeof(response))) {
    return refuse(absl::UnavailableError(
        absl::StrCat("moesnapd at ", path_, " closed the memory handoff connection")));
  }
  std::memcpy(&response, packet, sizeof(response));
  const size_t message_bytes = std::min<size_t>(
      {response.message_bytes, wire::kMaxMessageBytes, static_cast<size_t>(got) - sizeof(response)});
  if (response.magic != wire::kResponseMagic) {
    return refuse(absl::DataLossError(absl::StrCat(
        "moesnapd at ", path_, " answered a memory handoff with a malformed response")));
  }
  if (response.code != 0) {
    const auto code = response.code <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)
                          ? static_cast<absl::StatusCode>(response.code)
                          : absl::StatusCode::kUnknown;
    return refuse(absl::Status(code, std::string(packet + sizeof(response), message_bytes)));
  }
  if (received != nullptr) *received = attached;
  return response.first_id;
}

}  // namespace moesnap
