// Long operations an operator waits for (rebuild, verify; export will be one), as work done out of
// work known. moesnapctl draws its progress bar from them (Admin.Status lists them) and /metrics
// exposes them. One process-wide board, so any unit reports with two lines:
//   OperationProgress progress = ProgressBoard::Default().Begin("rebuild", total_bytes, "bytes");
//   progress.Advance(bytes);   // thread-safe, one relaxed atomic add
// The operation leaves the board when `progress` is destroyed.
#ifndef MOESNAP_DAEMON_PROGRESS_H_
#define MOESNAP_DAEMON_PROGRESS_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

class ProgressBoard;

// One running operation. Movable; its methods are thread-safe.
class OperationProgress {
 public:
  OperationProgress() = default;
  OperationProgress(OperationProgress&& other) noexcept { *this = std::move(other); }
  OperationProgress& operator=(OperationProgress&& other) noexcept;
  ~OperationProgress();

  void Advance(uint64_t amount);
  // The total grows when more work is found (a rebuild learns its stripes as it goes).
  void SetTotal(uint64_t total);

 private:
  friend class ProgressBoard;
  struct Entry {
    std::string kind;
    std::string unit;
    absl::Time started;
    std::atomic<uint64_t> done{0};
    std::atomic<uint64_t> total{0};
  };
  OperationProgress(ProgressBoard* board, int id, std::shared_ptr<Entry> entry)
      : board_(board), id_(id), entry_(std::move(entry)) {}

  ProgressBoard* board_ = nullptr;
  int id_ = 0;
  std::shared_ptr<Entry> entry_;
};

// Thread-safe.
class ProgressBoard {
 public:
  static ProgressBoard& Default();

  // `kind`: "rebuild", "verify", ...; `unit`: what done and total count ("bytes", "chunks").
  OperationProgress Begin(const std::string& kind, uint64_t total, const std::string& unit);
  // Every running operation, oldest first.
  std::vector<v1::OperationProgress> Running() const;

 private:
  friend class OperationProgress;
  void End(int id);

  mutable absl::Mutex mutex_;
  int next_id_ ABSL_GUARDED_BY(mutex_) = 0;
  std::map<int, std::shared_ptr<OperationProgress::Entry>> running_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_PROGRESS_H_
