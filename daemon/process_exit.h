// Whether a trainer process has exited, asked of the kernel by a pidfd: taken from the trainer's
// connection to the daemon (SO_PEERPIDFD), so that a pid reused by another process is never
// mistaken for it.
#ifndef MOESNAP_DAEMON_PROCESS_EXIT_H_
#define MOESNAP_DAEMON_PROCESS_EXIT_H_

#include <sys/socket.h>
#include <sys/types.h>

// Linux 6.5's socket option (WatchPeer); older C library headers lack its name.
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif

namespace moesnap::daemon {

// Owns its pidfd. Not copyable; movable.
class ProcessExit {
 public:
  // Watches `pid`. A pid the daemon cannot see (0: a peer in another pid namespace) or a kernel
  // without pidfds gives a watch that never says exited: memory is then never handed on.
  static ProcessExit Watch(pid_t pid);
  // Watches the process that connected the Unix socket `connection`, whose pid (as SO_PEERCRED
  // gave it) is `pid`: the pidfd comes from the socket (SO_PEERPIDFD, Linux 6.5), so it is that
  // process's even when it has died and its pid was taken by another since. A kernel without it
  // watches `pid` (Watch). A pid of 0 gives a watch that never says exited, as for Watch.
  static ProcessExit WatchPeer(int connection, pid_t pid);
  ProcessExit() = default;
  ~ProcessExit();
  ProcessExit(ProcessExit&& other) noexcept;
  ProcessExit& operator=(ProcessExit&& other) noexcept;
  ProcessExit(const ProcessExit&) = delete;
  ProcessExit& operator=(const ProcessExit&) = delete;

  // True once the process has terminated (a zombie counts: it runs no more code). Never blocks.
  bool Exited() const;
  // False for a watch that can never say exited.
  bool watching() const { return pidfd_ >= 0 || exited_; }
  pid_t pid() const { return pid_; }

 private:
  ProcessExit(pid_t pid, int pidfd, bool exited) : pid_(pid), pidfd_(pidfd), exited_(exited) {}

  pid_t pid_ = 0;
  int pidfd_ = -1;
  bool exited_ = false;  // gone before the watch began
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_PROCESS_EXIT_H_
