// RankActivity: the time of each rank's last activity, and the reason it is left out, if it is.
#include "daemon/rank_activity.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/metrics.h"

namespace moesnap::daemon {
namespace {

metrics::Counter& ranks_dropped = metrics::Registry::Default().AddCounter(
    "moesnap_ranks_dropped_total",
    "Ranks left out of this node's steps: idle past capture.idle_rank_timeout_ms, or dropped by an "
    "operator");

}  // namespace

void RankActivity::Active(uint32_t rank) {
  absl::MutexLock lock(&mutex_);
  State& state = ranks_[rank];
  state.last_active = absl::Now();
  if (state.dropped) {
    Log(LogLevel::kInfo, "rank ", rank, " is active again and takes part in this node's steps");
    state.dropped.reset();
  }
}

void RankActivity::Gone(uint32_t rank) {
  absl::MutexLock lock(&mutex_);
  ranks_.erase(rank);
}

void RankActivity::Drop(uint32_t rank) {
  absl::MutexLock lock(&mutex_);
  State& state = ranks_[rank];
  if (state.dropped) return;
  state.dropped = "dropped by an operator";
  Log(LogLevel::kWarning, "rank ", rank, " is left out of this node's steps until its next "
      "snapshot: dropped by an operator");
  ranks_dropped.Add(1);
}

std::optional<std::string> RankActivity::LeftOut(uint32_t rank) {
  absl::MutexLock lock(&mutex_);
  auto it = ranks_.find(rank);
  if (it == ranks_.end()) return std::nullopt;
  State& state = it->second;
  if (!state.dropped && idle_timeout_ > absl::ZeroDuration() &&
      absl::Now() - state.last_active >= idle_timeout_) {
    state.dropped = absl::StrCat("no snapshot for ", absl::FormatDuration(idle_timeout_),
                                 " (capture.idle_rank_timeout_ms)");
    Log(LogLevel::kWarning, "rank ", rank, " is left out of this node's steps until its next "
        "snapshot: ", *state.dropped);
    ranks_dropped.Add(1);
  }
  return state.dropped;
}

std::optional<absl::Time> RankActivity::NextIdleAt() const {
  if (idle_timeout_ <= absl::ZeroDuration()) return std::nullopt;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mutex_);
  std::optional<absl::Time> next;
  for (const auto& [rank, state] : ranks_) {
    if (state.dropped) continue;
    const absl::Time idle_at = state.last_active + idle_timeout_;
    if (idle_at > now && (!next || idle_at < *next)) next = idle_at;
  }
  return next;
}

std::map<uint32_t, std::string> RankActivity::Dropped() const {
  absl::MutexLock lock(&mutex_);
  std::map<uint32_t, std::string> dropped;
  for (const auto& [rank, state] : ranks_) {
    if (state.dropped) dropped[rank] = *state.dropped;
  }
  return dropped;
}

}  // namespace moesnap::daemon
