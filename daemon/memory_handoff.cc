// MemoryHandoff: poll over the adopted SOCK_SEQPACKET connections; recvmsg with SCM_RIGHTS.
#include "daemon/memory_handoff.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/memory_handoff_wire.h"

namespace moesnap::daemon {
namespace {

namespace wire = ::moesnap::memory_handoff;

// Answers a request; false when the answer cannot be sent (the trainer is gone or not reading).
bool Answer(int fd, const absl::Status& status, uint64_t first_id) {
  wire::Response response;
  response.code = static_cast<uint32_t>(status.code());
  response.first_id = first_id;
  const std::string message(status.message().substr(0, wire::kMaxMessageBytes));
  response.message_bytes = static_cast<uint32_t>(message.size());
  std::string packet(reinterpret_cast<const char*>(&response), sizeof(response));
  packet += message;
  return send(fd, packet.data(), packet.size(), MSG_DONTWAIT | MSG_NOSIGNAL) ==
         static_cast<ssize_t>(packet.size());
}

}  // namespace

MemoryHandoff::MemoryHandoff(TrainerSessions* sessions, Store* store,
                             std::vector<FileIdentity> own_files)
    : sessions_(sessions), store_(store), own_files_(std::move(own_files)) {
  if (pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
    Log(LogLevel::kError, "memory handoff: pipe(): ", std::strerror(errno));
  }
  thread_ = std::thread([this] { Serve(); });
}

MemoryHandoff::~MemoryHandoff() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  const char wake = 1;
  if (write(wake_pipe_[1], &wake, 1) != 1) Log(LogLevel::kError, "cannot wake the memory handoff");
  thread_.join();
  for (const auto& [fd, connection] : connections_) close(fd);
  absl::MutexLock lock(&mutex_);
  for (const auto& [fd, peer] : adopted_) close(fd);
  for (int fd : wake_pipe_) {
    if (fd >= 0) close(fd);
  }
}

void MemoryHandoff::Adopt(int connection, const ucred& peer) {
  {
    absl::MutexLock lock(&mutex_);
    adopted_.emplace_back(connection, peer);
  }
  const char wake = 1;
  (void)!write(wake_pipe_[1], &wake, 1);  // a full pipe already wakes the thread
}

void MemoryHandoff::Serve() {
  while (true) {
    {
      absl::MutexLock lock(&mutex_);
      if (stopping_) return;
      for (const auto& [fd, peer] : adopted_) {
        if (connections_.size() >= kMaxConnections) {
          Log(LogLevel::kWarning, "memory handoff: refused a connection from pid ", peer.pid,
              ": ", kMaxConnections, " are open");
          close(fd);
          continue;
        }
        connections_[fd].peer = peer;
      }
      adopted_.clear();
    }
    std::vector<pollfd> watched;
    watched.push_back({wake_pipe_[0], POLLIN, 0});
    for (const auto& [fd, connection] : connections_) watched.push_back({fd, POLLIN, 0});
    if (poll(watched.data(), watched.size(), -1) < 0) {
      if (errno == EINTR) continue;
      Log(LogLevel::kError, "memory handoff: poll failed: ", std::strerror(errno));
      return;
    }
    if (watched[0].revents != 0) {
      char drained[64];
      while (read(wake_pipe_[0], drained, sizeof(drained)) > 0) {
      }
    }
    for (size_t i = 1; i < watched.size(); ++i) {
      if (watched[i].revents == 0) continue;
      const int fd = watched[i].fd;
      Connection& connection = connections_.at(fd);
      if (!Handle(fd, connection)) {
        Close(fd, connection);
        connections_.erase(fd);
      }
    }
  }
}

bool MemoryHandoff::Handle(int fd, Connection& connection) {
  wire::Request request;
  iovec data{&request, sizeof(request)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * wire::kMaxFilesPerRequest)];
  msghdr message{};
  message.msg_iov = &data;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  const ssize_t received = recvmsg(fd, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (received < 0 && (errno == EAGAIN || errno == EINTR)) return true;
  if (received <= 0) return false;  // closed by the trainer, or broken

  std::vector<int> files;
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
       header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int file;
      std::memcpy(&file, CMSG_DATA(header) + i * sizeof(int), sizeof(int));
      files.push_back(file);
    }
  }
  auto close_files = [&files] {
    for (int file : files) close(file);
  };
  const std::string token(reinterpret_cast<const char*>(request.session), wire::kSessionBytes);
  absl::Status refused;
  if (received != sizeof(request) || request.magic != wire::kRequestMagic ||
      (message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    refused = absl::InvalidArgumentError(absl::StrCat(
        "malformed memory handoff request (", received, " bytes, at most ",
        wire::kMaxFilesPerRequest, " files per request)"));
  } else if (request.files != files.size()) {
    refused = absl::InvalidArgumentError(absl::StrCat("the request announces ", request.files,
                                                      " files but carries ", files.size()));
  } else if (!connection.token.empty() && connection.token != token) {
    refused = absl::InvalidArgumentError("a connection hands over memory for one session only");
  }
  if (!refused.ok()) {
    close_files();
    Log(LogLevel::kWarning, "memory handoff from pid ", connection.peer.pid, ": ",
        refused.message());
    Answer(fd, refused, 0);
    return false;
  }

  std::vector<std::shared_ptr<TrainerMemory>> mapped;
  absl::Status status;
  for (size_t i = 0; i < files.size() && status.ok(); ++i) {
    absl::StatusOr<std::shared_ptr<TrainerMemory>> memory =
        TrainerMemory::Map(files[i], connection.peer.uid, own_files_);
    if (memory.ok()) {
      mapped.push_back(*std::move(memory));
    } else {
      status = absl::Status(memory.status().code(),
                            absl::StrCat("file ", i, " of the request: ", memory.status().message()));
    }
  }
  close_files();  // the mappings stay
  uint64_t first_id = 0;
  if (status.ok()) {
    absl::StatusOr<uint64_t> added = sessions_->Add(token, std::move(mapped));
    if (added.ok()) {
      first_id = *added;
      connection.token = token;
    } else {
      status = added.status();
    }
  }
  return Answer(fd, status, first_id) && (status.ok() || !connection.token.empty());
}

void MemoryHandoff::Close(int fd, const Connection& connection) {
  close(fd);
  if (connection.token.empty()) return;
  if (std::optional<std::pair<uint32_t, uint64_t>> ended = sessions_->End(connection.token)) {
    Log(LogLevel::kInfo, "rank ", ended->first, " (pid ", connection.peer.pid,
        ") disconnected: its registrations and memory are released");
    store_->EndSession(ended->first, ended->second);
  }
}

}  // namespace moesnap::daemon
