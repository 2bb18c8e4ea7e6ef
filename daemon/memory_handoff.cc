// MemoryHandoff: poll over the adopted SOCK_SEQPACKET connections; recvmsg with SCM_RIGHTS.
#include "daemon/memory_handoff.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/descriptor_passing.h"
#include "common/log.h"
#include "common/memory_handoff_wire.h"

namespace moesnap::daemon {
namespace {

namespace wire = ::moesnap::memory_handoff;
static_assert(wire::kMaxFilesPerRequest <= kMaxPassedDescriptors);

// Answers a request, with `attached` (a descriptor, unless -1) handed over; false when the answer
// cannot be sent (the trainer is gone or not reading).
bool Answer(int fd, const absl::Status& status, uint64_t first_id, int attached = -1) {
  wire::Response response;
  response.code = static_cast<uint32_t>(status.code());
  response.first_id = first_id;
  const std::string message(status.message().substr(0, wire::kMaxMessageBytes));
  response.message_bytes = static_cast<uint32_t>(message.size());
  std::string packet(reinterpret_cast<const char*>(&response), sizeof(response));
  packet += message;
  return SendWithDescriptors(fd, packet.data(), packet.size(), &attached, attached >= 0 ? 1 : 0,
                             MSG_DONTWAIT | MSG_NOSIGNAL) == static_cast<ssize_t>(packet.size());
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
        Connection& connection = connections_[fd];
        connection.peer = peer;
        if (sessions_->keeps_exited_memory()) {
          // From the connection itself: the process that connected, even if it died right after
          // and its pid was reused.
          connection.process = ProcessExit::WatchPeer(fd, peer.pid);
          if (peer.pid == 0 && !warned_pid_namespace_) {
            warned_pid_namespace_ = true;
            Log(LogLevel::kWarning, "a trainer connected from another pid namespace: the memory "
                "of trainers whose pids this daemon cannot see is not kept for their restart "
                "(run moesnapd in the trainers' pid namespace, e.g. hostPID in Kubernetes)");
          }
        }
      }
      adopted_.clear();
    }
    std::vector<pollfd> watched;
    watched.push_back({wake_pipe_[0], POLLIN, 0});
    for (const auto& [fd, connection] : connections_) watched.push_back({fd, POLLIN, 0});
    const absl::Time now = absl::Now();
    const absl::Time next_expiry = sessions_->ReleaseExpired(now);
    // Memory is kept from other threads too (a Hello replacing a session): look again at least
    // once a minute while it may be.
    constexpr absl::Duration kLongestWait = absl::Minutes(1);
    const int timeout_ms =
        !sessions_->keeps_exited_memory()
            ? -1
            : static_cast<int>(absl::ToInt64Milliseconds(std::clamp(
                  next_expiry - now + absl::Milliseconds(1), absl::Milliseconds(1), kLongestWait)));
    if (poll(watched.data(), watched.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      Log(LogLevel::kError, "memory handoff: poll failed: ", std::strerror(errno));
      return;
    }
    if (watched[0].revents != 0) {
      char drained[64];
      while (read(wake_pipe_[0], drained, sizeof(drained)) > 0) {
      }
    }
    // Connections whose trainer hung up first: a restarted trainer asking for the memory its
    // predecessor left finds that predecessor's session ended, whatever the descriptors' order.
    std::stable_partition(watched.begin() + 1, watched.end(), [](const pollfd& polled) {
      return (polled.revents & (POLLHUP | POLLERR)) != 0;
    });
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
  alignas(8) char packet[std::max(sizeof(wire::Request), sizeof(wire::AdoptRequest))];
  ReceivedMessage message = ReceiveWithDescriptors(fd, packet, sizeof(packet), MSG_DONTWAIT);
  const ssize_t received = message.bytes;
  if (received < 0 && (errno == EAGAIN || errno == EINTR)) return true;
  if (received <= 0) return false;  // closed by the trainer, or broken

  std::vector<int> files = std::move(message.descriptors);
  auto close_files = [&files] {
    for (int file : files) close(file);
  };
  uint32_t magic = 0;
  std::memcpy(&magic, packet, std::min<size_t>(sizeof(magic), static_cast<size_t>(received)));
  const bool truncated = message.truncated;
  if (magic == wire::kAdoptMagic && received == sizeof(wire::AdoptRequest) && !truncated) {
    const bool carried_files = !files.empty();
    close_files();
    wire::AdoptRequest adopt;
    std::memcpy(&adopt, packet, sizeof(adopt));
    return HandleAdopt(fd, connection, adopt, carried_files);
  }
  wire::Request request;
  std::memcpy(&request, packet, std::min<size_t>(sizeof(request), static_cast<size_t>(received)));
  const std::string token(reinterpret_cast<const char*>(request.session), wire::kSessionBytes);
  absl::Status refused;
  if (received != sizeof(request) || request.magic != wire::kRequestMagic || truncated) {
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
        TrainerMemory::Map(files[i], connection.peer.uid, own_files_,
                           sessions_->keeps_exited_memory());
    if (memory.ok()) {
      mapped.push_back(*std::move(memory));
    } else {
      status = absl::Status(memory.status().code(),
                            absl::StrCat("file ", i, " of the request: ", memory.status().message()));
    }
  }
  close_files();  // the mappings stay
  if (status.ok() && connection.token.empty()) {
    status = sessions_->Bind(token, std::move(connection.process));
    if (status.ok()) connection.token = token;
  }
  uint64_t first_id = 0;
  if (status.ok()) {
    absl::StatusOr<uint64_t> added = sessions_->Add(token, std::move(mapped));
    if (added.ok()) {
      first_id = *added;
    } else {
      status = added.status();
    }
  }
  return Answer(fd, status, first_id) && (status.ok() || !connection.token.empty());
}

bool MemoryHandoff::HandleAdopt(int fd, Connection& connection,
                                const wire::AdoptRequest& request, bool carried_files) {
  const std::string token(reinterpret_cast<const char*>(request.session), wire::kSessionBytes);
  absl::Status refused;
  if (carried_files || request.reserved != 0) {
    refused = absl::InvalidArgumentError(
        "a request to adopt memory carries no files, and its reserved field is 0");
  } else if (connection.token.empty() || connection.token != token) {
    refused = absl::InvalidArgumentError(
        "memory is adopted only on a connection bound to the session asking");
  }
  if (!refused.ok()) {
    Log(LogLevel::kWarning, "memory handoff from pid ", connection.peer.pid, ": ",
        refused.message());
    Answer(fd, refused, 0);
    return false;
  }
  // Asked of the store before the sessions are locked: no copy of the earlier process's memory can
  // start once its session is over, so the answer stays true for it.
  absl::StatusOr<uint32_t> rank = sessions_->RankOf(token);
  const bool copying = rank.ok() && store_->CopyingTrainerMemory(*rank);
  absl::StatusOr<TrainerSessions::Adopted> adopted =
      sessions_->Adopt(token, request.bytes, connection.peer.uid, copying);
  if (!adopted.ok()) {
    Log(LogLevel::kDebug, "pid ", connection.peer.pid, " allocates its ", request.bytes,
        " bytes afresh: ", adopted.status().message());
    return Answer(fd, adopted.status(), 0);
  }
  Log(LogLevel::kInfo, "pid ", connection.peer.pid, " took a file of ", adopted->memory->bytes(),
      " bytes", adopted->memory->huge_page_bytes() > 0 ? " in huge pages" : "",
      " that an exited process of its rank left");
  return Answer(fd, absl::OkStatus(), adopted->id, adopted->memory->kept_fd());
}

void MemoryHandoff::Close(int fd, const Connection& connection) {
  close(fd);
  if (connection.token.empty()) return;
  if (std::optional<TrainerSessions::Ended> ended = sessions_->End(connection.token)) {
    Log(LogLevel::kInfo, "rank ", ended->rank, " (pid ", connection.peer.pid, ") disconnected: ",
        ended->kept_bytes == 0
            ? std::string("its registrations and memory are released")
            : absl::StrCat("its registrations are released, ", ended->kept_bytes,
                           " bytes of its memory kept for the rank's next process"));
    store_->EndSession(ended->rank, ended->number);
  }
}

}  // namespace moesnap::daemon
