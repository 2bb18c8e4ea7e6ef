// A fixed set of threads running queued tasks in order of submission: the capture threads.
#ifndef MOESNAP_DAEMON_WORKER_POOL_H_
#define MOESNAP_DAEMON_WORKER_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace moesnap::daemon {

// Thread-safe. The destructor runs every task already queued, then joins the threads.
class WorkerPool {
 public:
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void Submit(std::function<void()> task);
  // Queues every task under one lock acquisition, so the workers start once all are queued.
  void SubmitAll(std::vector<std::function<void()>> tasks);
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Run();

  absl::Mutex mutex_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_WORKER_POOL_H_
