// The daemon's side of the memory handoff (common/memory_handoff_wire.h): takes trainers'
// connections on the memory socket, maps the files they send into their sessions, hands a
// restarted trainer a file its rank's exited process left, and when a connection closes (the
// trainer exited or died) ends its session, so the rank's registrations are released without
// guessing from process ids (and its larger files kept for a while for the rank's next process).
#ifndef MOESNAP_DAEMON_MEMORY_HANDOFF_H_
#define MOESNAP_DAEMON_MEMORY_HANDOFF_H_

#include <sys/socket.h>

#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/memory_handoff_wire.h"
#include "daemon/process_exit.h"
#include "daemon/store.h"
#include "daemon/trainer_memory.h"
#include "daemon/unix_server.h"

namespace moesnap::daemon {

// Serves every adopted connection from one thread; a request is answered before the next is read.
class MemoryHandoff : public ConnectionHandler {
 public:
  // Connections beyond this are closed at once.
  static constexpr size_t kMaxConnections = 4096;

  // Files in `own_files` (the daemon's pool and journal) are refused, whoever hands them over.
  MemoryHandoff(TrainerSessions* sessions, Store* store, std::vector<FileIdentity> own_files);
  ~MemoryHandoff() override;  // closes every connection (sessions are not ended: the daemon stops)

  void Adopt(int connection, const ucred& peer) override;

 private:
  struct Connection {
    std::string token;  // bound by the first request
    ucred peer{};
    ProcessExit process;  // the peer, watched by its session once bound (TrainerSessions::Bind)
  };

  void Serve();
  // Reads one request and answers it; false when the connection is to be closed.
  bool Handle(int fd, Connection& connection);
  bool HandleAdopt(int fd, Connection& connection, const memory_handoff::AdoptRequest& request,
                   bool carried_files);
  void Close(int fd, const Connection& connection);

  TrainerSessions* const sessions_;
  Store* const store_;
  const std::vector<FileIdentity> own_files_;
  int wake_pipe_[2] = {-1, -1};
  absl::Mutex mutex_;
  std::vector<std::pair<int, ucred>> adopted_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::map<int, Connection> connections_;  // the serving thread's own
  bool warned_pid_namespace_ = false;      // the serving thread's own
  std::thread thread_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_MEMORY_HANDOFF_H_
