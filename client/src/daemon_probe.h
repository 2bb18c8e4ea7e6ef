// Whether the daemon answers at all. A call that ran out of time met either a slow step (a wait for
// a commit the cluster has not decided) or a daemon that answers nothing (stopped, stuck on a disk);
// a health check on the same channel tells which. While the daemon answers nothing, the client's
// calls are refused at once instead of each waiting out its timeout, so a hung daemon costs the
// training loop one timeout, not one every step; a health check stays in flight meanwhile, so the
// daemon's answer to it, the moment it runs again, lets calls through again.
#ifndef MOESNAP_CLIENT_SRC_DAEMON_PROBE_H_
#define MOESNAP_CLIENT_SRC_DAEMON_PROBE_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace moesnap {

// Thread-safe.
class DaemonProbe {
 public:
  // A health check waits up to `check_timeout` for its answer. `socket_path` names the daemon in
  // refusals.
  DaemonProbe(std::shared_ptr<grpc::Channel> channel, std::string socket_path,
              std::chrono::milliseconds check_timeout);
  // Cancels a health check in flight and waits for it to end.
  ~DaemonProbe();
  DaemonProbe(const DaemonProbe&) = delete;
  DaemonProbe& operator=(const DaemonProbe&) = delete;

  // OK unless the daemon has answered nothing since a call ran out of time: then UNAVAILABLE,
  // naming that call.
  absl::Status Admit();
  // `call` ran out of its time: checks the daemon's health, and returns once a check has ended.
  void RanOut(absl::string_view call);

 private:
  struct Check;  // one health check in flight

  void StartCheckLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void Ended(const grpc::Status& status);

  grpc::GenericStub stub_;
  const std::string socket_path_;
  const std::chrono::milliseconds check_timeout_;
  const std::string method_ = "/grpc.health.v1.Health/Check";

  absl::Mutex mutex_;
  std::unique_ptr<Check> in_flight_ ABSL_GUARDED_BY(mutex_);    // null when none is in flight
  std::unique_ptr<Check> ended_check_ ABSL_GUARDED_BY(mutex_);  // the last one, once it ended
  uint64_t checks_ended_ ABSL_GUARDED_BY(mutex_) = 0;
  bool answers_ ABSL_GUARDED_BY(mutex_) = true;     // the last check's verdict (true before any)
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;   // the destructor runs: no check starts again
  std::string unanswered_ ABSL_GUARDED_BY(mutex_);  // the call that ran out of time
};

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SRC_DAEMON_PROBE_H_
