// CallerGate: a count per caller under one lock; a caller's entry goes when its last call ends.
#include "daemon/caller_gate.h"

#include "absl/strings/str_cat.h"
#include "common/metrics.h"

namespace moesnap::daemon {

CallerGate::Pass::~Pass() {
  if (gate_ != nullptr) gate_->Leave(caller_);
}

absl::StatusOr<CallerGate::Pass> CallerGate::Enter(const std::string& caller) {
  absl::MutexLock lock(&mutex_);
  int& count = in_flight_[caller];
  if (count >= per_caller_) {
    refused_->Add(1);
    return absl::ResourceExhaustedError(absl::StrCat(
        caller, " has ", count, " calls in flight, the most one caller may have at once"));
  }
  ++count;
  return Pass(this, caller);
}

int CallerGate::in_flight(const std::string& caller) const {
  absl::MutexLock lock(&mutex_);
  auto it = in_flight_.find(caller);
  return it == in_flight_.end() ? 0 : it->second;
}

void CallerGate::Leave(const std::string& caller) {
  absl::MutexLock lock(&mutex_);
  auto it = in_flight_.find(caller);
  if (--it->second == 0) in_flight_.erase(it);
}

}  // namespace moesnap::daemon
