// Drainer: the commit observer, the drain thread, and retention.
#include "daemon/durable/drainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/byte_size.h"
#include "common/log.h"

namespace moesnap::daemon::durable {
namespace {

// The drain thread's nice value (Linux nices threads one by one).
constexpr int kDrainNice = 19;

}  // namespace

Drainer::Drainer(const DurableOptions& options, const StepIdentity& identity, DurableStore* store,
                 JobView* view, Clock* clock)
    : options_(options), identity_(identity),
      schedule_(options.every_steps, options.every_seconds),
      directory_(options.directory, identity.node_id), store_(store), view_(view), clock_(clock) {
  absl::MutexLock lock(&mutex_);
  last_commit_ = clock_->Now();
  status_.set_enabled(true);
  status_.set_directory(directory_.path());
}

Drainer::~Drainer() {
  stop_ = true;  // a write in progress gives up at its next piece
  bool started = false;
  {
    absl::MutexLock lock(&mutex_);
    started = started_;
  }
  if (started) store_->SetCommitObserver(nullptr);  // no Committed call runs after this returns
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    pending_.reset();
    wake_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

void Drainer::Start() {
  absl::Status ready = directory_.Create();
  if (ready.ok()) {
    absl::StatusOr<int> removed = directory_.RemoveLeftovers();
    if (removed.ok() && *removed > 0) {
      Log(LogLevel::kInfo, "durable tier: removed ", *removed,
          " partial steps left by a drain or deletion that was interrupted");
    }
    ready = removed.status();
  }
  absl::StatusOr<std::vector<int64_t>> steps =
      ready.ok() ? directory_.Steps() : absl::StatusOr<std::vector<int64_t>>(ready);
  {
    absl::MutexLock lock(&mutex_);
    if (steps.ok()) {
      if (!steps->empty()) status_.set_latest_step(steps->back());
      Log(LogLevel::kInfo, "durable tier in ", directory_.path(), ": ", steps->size(),
          " complete steps", steps->empty() ? "" : absl::StrCat(", the newest ", steps->back()));
    } else {
      status_.set_last_error(absl::StrCat("the durable directory cannot be used: ",
                                          steps.status().message()));
      status_.set_last_error_unix_ms(absl::ToUnixMillis(clock_->Now()));
      Log(LogLevel::kError, "durable tier: ", status_.last_error(),
          "; training goes on, drains retry at each due step");
    }
    started_ = true;
  }
  thread_ = std::thread([this] { Run(); });
  store_->SetCommitObserver(this);
}

void Drainer::Committed(std::optional<int64_t> previous, int64_t step,
                        const std::function<NodeImage()>& image) {
  absl::MutexLock lock(&mutex_);
  const absl::Time now = clock_->Now();
  const bool due = schedule_.Due(previous, step, last_commit_, now);
  last_commit_ = now;
  if (!due || stopping_) return;
  if (status_.has_draining_step()) {
    status_.set_drains_skipped(status_.drains_skipped() + 1);
    Log(LogLevel::kInfo, "durable tier: step ", step, " is due but step ", status_.draining_step(),
        " is still being drained; skipping it (the disk is slower than the schedule)");
    return;
  }
  pending_.emplace(step, image());
  status_.set_draining_step(step);  // from now on: a newer due step is skipped, not queued
  status_.set_draining_bytes(pending_->second.bytes());
  written_ = 0;
  wake_.SignalAll();
}

void Drainer::Run() {
  // Background work: the capture threads, which a trainer may wait on, get the CPU first.
  if (setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), kDrainNice) != 0) {
    Log(LogLevel::kDebug, "durable tier: the drain thread keeps its priority: ", std::strerror(errno));
  }
  while (true) {
    std::optional<std::pair<int64_t, NodeImage>> work;
    {
      absl::MutexLock lock(&mutex_);
      while (!pending_ && !stopping_) wake_.Wait(&mutex_);
      if (stopping_) return;
      work = std::move(pending_);
      pending_.reset();
    }
    Drain(work->first, work->second);
    work.reset();  // lets go of the image: its versions may be freed now
    absl::MutexLock lock(&mutex_);
    status_.clear_draining_step();
    status_.set_draining_bytes(0);
    wake_.SignalAll();
  }
}

void Drainer::Drain(int64_t step, const NodeImage& image) {
  absl::Status ready = directory_.Create();  // the folder may have been fixed since the start
  absl::StatusOr<WrittenStep> written =
      ready.ok() ? WriteStep(directory_, step, image, identity_, {options_.bytes_per_second},
                             clock_, &written_, stop_)
                 : absl::StatusOr<WrittenStep>(ready);
  {
    absl::MutexLock lock(&mutex_);
    if (!written.ok()) {
      status_.set_drains_failed(status_.drains_failed() + 1);
      status_.set_last_error(absl::StrCat(
          "drain of step ", step, " to ", directory_.path(), " failed: ", written.status().message(),
          status_.has_latest_step()
              ? absl::StrCat("; step ", status_.latest_step(), " stays the newest durable step")
              : "; no step is durable yet"));
      status_.set_last_error_unix_ms(absl::ToUnixMillis(clock_->Now()));
      Log(absl::IsCancelled(written.status()) ? LogLevel::kInfo : LogLevel::kWarning,
          "durable tier: ", status_.last_error(), "; training goes on");
      return;
    }
    status_.set_latest_step(step);
    status_.set_drains_completed(status_.drains_completed() + 1);
    status_.clear_last_error();
    status_.set_last_error_unix_ms(0);
    status_.set_last_drain_seconds(absl::ToDoubleSeconds(written->took));
    status_.set_last_drain_bytes(written->bytes);
  }
  Log(LogLevel::kInfo, "durable tier: step ", step, " is durable (", FormatByteSize(written->bytes),
      " in ", absl::FormatDuration(written->took), ")");
  Retain();
  Record();
}

void Drainer::Record() {
  absl::MutexLock record_lock(&record_mutex_);
  absl::StatusOr<std::vector<int64_t>> steps = directory_.Steps();
  absl::Status recorded = steps.ok() ? view_->RecordDurable(*steps) : steps.status();
  if (recorded.ok()) return;
  absl::MutexLock lock(&mutex_);
  status_.set_last_error(absl::StrCat(
      "the steps on this node's disk could not be recorded for the job: ", recorded.message(),
      "; a step counts as durable on every node only once each node's record lists it (the next "
      "drain records again)"));
  status_.set_last_error_unix_ms(absl::ToUnixMillis(clock_->Now()));
  Log(LogLevel::kWarning, "durable tier: ", status_.last_error());
}

void Drainer::Retain() {
  absl::StatusOr<std::vector<int64_t>> steps = directory_.Steps();
  if (!steps.ok()) {
    Log(LogLevel::kWarning, "durable tier: cannot list ", directory_.path(), " to delete old steps: ",
        steps.status().message());
    return;
  }
  if (steps->size() <= options_.keep) return;
  const absl::StatusOr<DurableEverywhere> everywhere = view_->NewestDurableEverywhere(*steps);
  std::optional<int64_t> spared;
  {
    absl::MutexLock lock(&mutex_);
    if (everywhere.ok() && everywhere->step) durable_everywhere_ = everywhere->step;
    spared = durable_everywhere_;
  }
  const size_t deletable = steps->size() - options_.keep;
  for (size_t i = 0; i < deletable; ++i) {
    const int64_t step = (*steps)[i];
    if (step == spared) continue;
    if (absl::Status status = directory_.Remove(step); !status.ok()) {
      Log(LogLevel::kWarning, "durable tier: cannot delete step ", step, ": ", status.message());
    } else {
      Log(LogLevel::kDebug, "durable tier: deleted step ", step, " (keep = ", options_.keep, ")");
    }
  }
}

v1::DurableStatus Drainer::Status() const {
  absl::MutexLock lock(&mutex_);
  v1::DurableStatus status = status_;
  if (status.has_draining_step()) status.set_draining_bytes_written(written_.load());
  return status;
}

absl::Status Drainer::DiscardAfter(int64_t step) {
  absl::StatusOr<std::vector<int64_t>> steps = directory_.Steps();
  if (!steps.ok()) return steps.status();
  bool removed = false;
  absl::Status status;
  for (int64_t later : *steps) {
    if (later <= step) continue;
    status = directory_.Remove(later);
    if (!status.ok()) break;
    removed = true;
    Log(LogLevel::kInfo, "durable tier: deleted step ", later, ", written by the run that a restore "
        "from step ", step, " abandons");
  }
  if (removed) Record();
  absl::StatusOr<std::vector<int64_t>> kept = directory_.Steps();
  absl::MutexLock lock(&mutex_);
  status_.clear_latest_step();
  if (kept.ok() && !kept->empty()) status_.set_latest_step(kept->back());
  if (durable_everywhere_ && *durable_everywhere_ > step) durable_everywhere_.reset();
  return status.ok() ? kept.status() : status;
}

bool Drainer::WaitIdle(absl::Time deadline) const {
  absl::MutexLock lock(&mutex_);
  while (status_.has_draining_step()) {
    if (wake_.WaitWithDeadline(&mutex_, deadline)) return false;
  }
  return true;
}

}  // namespace moesnap::daemon::durable
