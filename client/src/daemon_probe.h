// Whether the daemon answers at all. A call that ran out of time met either a slow step (a wait for
// a commit the cluster has not decided) or a daemon that answers nothing (stopped, or not serving
// yet); a health check on the same channel tells which. gRPC answers health checks on threads of
// its own, so a daemon whose calls are blocked still answers them: only a daemon that serves no
// gRPC at all is found out. While it answers nothing, the client's calls are refused at once instead
// of each waiting out its timeout, so such a daemon costs the training loop one call timeout and a
// health check, not a call timeout every step. A health check stays in flight meanwhile, so the
// daemon's answer to it, however late, lets calls through again.
#ifndef MOESNAP_CLIENT_SRC_DAEMON_PROBE_H_
#define MOESNAP_CLIENT_SRC_DAEMON_PROBE_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
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
  // The health check that follows a call that ran out of time waits up to `verdict_timeout` for its
  // answer; the ones that follow an unanswered check, up to `recheck_timeout` each. `socket_path`
  // names the daemon in refusals.
  DaemonProbe(std::shared_ptr<grpc::Channel> channel, std::string socket_path,
              std::chrono::milliseconds verdict_timeout, std::chrono::milliseconds recheck_timeout);
  // Cancels a health check in flight and waits for it to end.
  ~DaemonProbe();
  DaemonProbe(const DaemonProbe&) = delete;
  DaemonProbe& operator=(const DaemonProbe&) = delete;

  // OK unless the daemon has answered nothing since a call ran out of time: then UNAVAILABLE,
  // naming that call.
  absl::Status Admit();
  // `call` ran out of its time: checks the daemon's health, and returns once a check has ended
  // (at once when the daemon is known to serve nothing already).
  void RanOut(absl::string_view call);

 private:
  struct HealthCheck;  // one in flight

  void StartCheckLocked(std::chrono::milliseconds timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void Ended(const grpc::Status& status);

  grpc::GenericStub stub_;
  const std::string socket_path_;
  const std::chrono::milliseconds verdict_timeout_;
  const std::chrono::milliseconds recheck_timeout_;
  // gRPC keeps a pointer to the name in each call's context: it outlives them (declared before).
  const std::string method_ = "/grpc.health.v1.Health/Check";

  absl::Mutex mutex_;
  std::unique_ptr<HealthCheck> in_flight_ ABSL_GUARDED_BY(mutex_);  // null when none is
  // The check that ended last. A context is freed only once its call is over, and a new check
  // starts from the callback of the one before: that callback's context is freed by the next one.
  std::unique_ptr<HealthCheck> ended_ ABSL_GUARDED_BY(mutex_);
  uint64_t checks_ended_ ABSL_GUARDED_BY(mutex_) = 0;
  bool answers_ ABSL_GUARDED_BY(mutex_) = true;     // the last check's verdict (true before any)
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;   // the destructor runs: no check starts again
  std::string unanswered_ ABSL_GUARDED_BY(mutex_);  // the call that ran out of time
};

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SRC_DAEMON_PROBE_H_
