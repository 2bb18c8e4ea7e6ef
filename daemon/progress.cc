// ProgressBoard: a map of running operations under a lock taken only to begin, end and list them.
#include "daemon/progress.h"

#include "absl/time/clock.h"

namespace moesnap::daemon {

OperationProgress& OperationProgress::operator=(OperationProgress&& other) noexcept {
  if (this != &other) {
    if (board_ != nullptr) board_->End(id_);
    board_ = std::exchange(other.board_, nullptr);
    id_ = other.id_;
    entry_ = std::move(other.entry_);
  }
  return *this;
}

OperationProgress::~OperationProgress() {
  if (board_ != nullptr) board_->End(id_);
}

void OperationProgress::Advance(uint64_t amount) {
  if (entry_) entry_->done.fetch_add(amount, std::memory_order_relaxed);
}

void OperationProgress::SetTotal(uint64_t total) {
  if (entry_) entry_->total.store(total, std::memory_order_relaxed);
}

ProgressBoard& ProgressBoard::Default() {
  static ProgressBoard* board = new ProgressBoard();  // never destroyed: outlives every thread
  return *board;
}

OperationProgress ProgressBoard::Begin(const std::string& kind, uint64_t total,
                                       const std::string& unit) {
  auto entry = std::make_shared<OperationProgress::Entry>();
  entry->kind = kind;
  entry->unit = unit;
  entry->started = absl::Now();
  entry->total = total;
  absl::MutexLock lock(&mutex_);
  const int id = next_id_++;
  running_.emplace(id, entry);
  return OperationProgress(this, id, std::move(entry));
}

void ProgressBoard::End(int id) {
  absl::MutexLock lock(&mutex_);
  running_.erase(id);
}

std::vector<v1::OperationProgress> ProgressBoard::Running() const {
  absl::MutexLock lock(&mutex_);
  std::vector<v1::OperationProgress> running;
  for (const auto& [id, entry] : running_) {
    v1::OperationProgress& progress = running.emplace_back();
    progress.set_kind(entry->kind);
    progress.set_unit(entry->unit);
    progress.set_done(entry->done.load(std::memory_order_relaxed));
    progress.set_total(entry->total.load(std::memory_order_relaxed));
    progress.set_seconds(absl::ToDoubleSeconds(absl::Now() - entry->started));
  }
  return running;
}

}  // namespace moesnap::daemon
