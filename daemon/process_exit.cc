// ProcessExit: a pidfd from the peer's socket or pidfd_open(2), and poll(2) on it (readable once
// the process terminates).
#include "daemon/process_exit.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

namespace moesnap::daemon {

ProcessExit ProcessExit::Watch(pid_t pid) {
  if (pid <= 0) return ProcessExit(pid, -1, false);
  const long pidfd = syscall(SYS_pidfd_open, pid, 0);
  if (pidfd >= 0) return ProcessExit(pid, static_cast<int>(pidfd), false);
  // ESRCH: the process is gone already. Anything else (no pidfds here): never known to exit.
  return ProcessExit(pid, -1, errno == ESRCH);
}

ProcessExit ProcessExit::WatchPeer(int connection, pid_t pid) {
  if (pid <= 0) return ProcessExit(pid, -1, false);
  int pidfd = -1;
  socklen_t length = sizeof(pidfd);
  if (getsockopt(connection, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &length) == 0 && pidfd >= 0) {
    return ProcessExit(pid, pidfd, false);
  }
  // ESRCH: the peer is gone already (kernels that give no pidfd of an exited process say so).
  if (errno == ESRCH) return ProcessExit(pid, -1, true);
  return Watch(pid);  // ENOPROTOOPT: no SO_PEERPIDFD here
}

ProcessExit::~ProcessExit() {
  if (pidfd_ >= 0) close(pidfd_);
}

ProcessExit::ProcessExit(ProcessExit&& other) noexcept
    : pid_(other.pid_), pidfd_(std::exchange(other.pidfd_, -1)), exited_(other.exited_) {}

ProcessExit& ProcessExit::operator=(ProcessExit&& other) noexcept {
  if (this != &other) {
    if (pidfd_ >= 0) close(pidfd_);
    pid_ = other.pid_;
    pidfd_ = std::exchange(other.pidfd_, -1);
    exited_ = other.exited_;
  }
  return *this;
}

bool ProcessExit::Exited() const {
  if (exited_) return true;
  if (pidfd_ < 0) return false;
  pollfd state{pidfd_, POLLIN, 0};
  return poll(&state, 1, 0) == 1 && (state.revents & POLLIN) != 0;
}

}  // namespace moesnap::daemon
