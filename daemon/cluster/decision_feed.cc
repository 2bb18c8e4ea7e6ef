// DecisionFeed: read, apply, watch from the read's revision; read again when the watch cannot go on.
#include "daemon/cluster/decision_feed.h"

#include "absl/time/clock.h"
#include "common/log.h"

namespace moesnap::daemon::cluster {
namespace {

constexpr absl::Duration kWatchWake = absl::Milliseconds(200);
constexpr absl::Duration kRetry = absl::Milliseconds(200);

}  // namespace

DecisionFeed::DecisionFeed(EtcdSession* session, const EtcdKeys& keys, DecisionLog* log,
                           Participant* participant)
    : session_(session), keys_(keys), log_(log), participant_(participant) {}

DecisionFeed::~DecisionFeed() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    changed_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

void DecisionFeed::Start() {
  thread_ = std::thread([this] { Run(); });
}

bool DecisionFeed::stopping() const {
  absl::MutexLock lock(&mutex_);
  return stopping_;
}

void DecisionFeed::Run() {
  while (!stopping()) {
    // The revision first, then the decisions: a decision written in between is read and also
    // watched, and applying one twice changes nothing.
    absl::StatusOr<etcd::RangeResult> probe =
        session_->client().GetPrefix(keys_.Steps(), {.limit = 1});
    absl::StatusOr<std::vector<v1::StepDecision>> decisions =
        probe.ok() ? log_->DecisionsAfter(participant_->CommittedStep())
                   : absl::StatusOr<std::vector<v1::StepDecision>>(probe.status());
    session_->Note(decisions.status());
    if (!decisions.ok()) {
      absl::MutexLock lock(&mutex_);
      changed_.WaitWithTimeout(&mutex_, kRetry);
      continue;
    }
    for (const v1::StepDecision& decision : *decisions) participant_->Apply(decision);
    absl::StatusOr<std::unique_ptr<etcd::Watcher>> watcher =
        session_->client().WatchPrefix(keys_.Steps(), probe->revision + 1);
    if (!watcher.ok()) continue;
    while (!stopping()) {
      absl::StatusOr<etcd::WatchEvent> event = (*watcher)->Next(kWatchWake);
      if (absl::IsDeadlineExceeded(event.status())) continue;
      if (!event.ok()) {
        Log(LogLevel::kWarning, "decisions: the watch ended (", event.status().message(),
            "); reading them again");
        break;
      }
      if (event->type != etcd::WatchEvent::Type::kPut) continue;  // old decisions dropped
      v1::StepDecision decision;
      const std::optional<int64_t> step = keys_.StepOf(event->kv.key);
      if (!step || !decision.ParseFromString(event->kv.value) || decision.step() != *step) {
        Log(LogLevel::kError, "decisions: etcd key ", event->kv.key, " holds no decision of its step");
        continue;
      }
      participant_->Apply(decision);
    }
  }
}

}  // namespace moesnap::daemon::cluster
