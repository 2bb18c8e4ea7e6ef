// DaemonProbe: gRPC's standard health check (which every moesnapd serves), sent as a generic call
// so the client needs no generated health stub; one check in flight at a time, back to back while
// the daemon answers none.
#include "client/src/daemon_probe.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace moesnap {

struct DaemonProbe::HealthCheck {
  grpc::ClientContext context;
  grpc::Slice empty;  // an empty HealthCheckRequest: the daemon as a whole
  grpc::ByteBuffer request{&empty, 1};
  grpc::ByteBuffer response;
};

DaemonProbe::DaemonProbe(std::shared_ptr<grpc::Channel> channel, std::string socket_path,
                         std::chrono::milliseconds verdict_timeout,
                         std::chrono::milliseconds recheck_timeout)
    : stub_(std::move(channel)), socket_path_(std::move(socket_path)),
      verdict_timeout_(verdict_timeout), recheck_timeout_(recheck_timeout) {}

DaemonProbe::~DaemonProbe() {
  absl::MutexLock lock(&mutex_);
  stopping_ = true;
  if (in_flight_ != nullptr) in_flight_->context.TryCancel();
  mutex_.Await(absl::Condition(
      +[](std::unique_ptr<HealthCheck>* in_flight) { return *in_flight == nullptr; }, &in_flight_));
}

absl::Status DaemonProbe::Admit() {
  absl::MutexLock lock(&mutex_);
  if (answers_) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "moesnapd at ", socket_path_, " has answered nothing since ", unanswered_,
      " ran out of time (nor a health check within ", verdict_timeout_.count(),
      " ms): calls are refused at once until it answers one"));
}

void DaemonProbe::RanOut(absl::string_view call) {
  absl::MutexLock lock(&mutex_);
  if (!answers_) return;  // the verdict is out: the checks in flight now only wait for an answer
  unanswered_ = std::string(call);
  const uint64_t ended_before = checks_ended_;
  if (in_flight_ == nullptr) StartCheckLocked(verdict_timeout_);
  auto ended = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    return checks_ended_ != ended_before || stopping_;
  };
  mutex_.Await(absl::Condition(&ended));
}

void DaemonProbe::StartCheckLocked(std::chrono::milliseconds timeout) {
  ended_.reset();
  in_flight_ = std::make_unique<HealthCheck>();
  HealthCheck* check = in_flight_.get();
  check->context.set_deadline(std::chrono::system_clock::now() + timeout);
  stub_.UnaryCall(&check->context, method_, grpc::StubOptions(), &check->request,
                  &check->response, [this](grpc::Status status) { Ended(status); });
}

void DaemonProbe::Ended(const grpc::Status& status) {
  absl::MutexLock lock(&mutex_);
  // Any answer says the daemon runs: SERVING or not, a refusal, even "unavailable" from a daemon
  // that is gone (the reconnection to the next one is the calls' business). Only silence until the
  // deadline says it hangs; a check cancelled by the destructor decides nothing.
  if (status.error_code() != grpc::StatusCode::CANCELLED) {
    answers_ = status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED;
  }
  ++checks_ended_;
  std::unique_ptr<HealthCheck> ended = std::move(in_flight_);
  // Silent: the next check waits in the daemon's socket, answered the moment the daemon serves.
  if (!answers_ && !stopping_) StartCheckLocked(recheck_timeout_);
  ended_ = std::move(ended);
}

}  // namespace moesnap
