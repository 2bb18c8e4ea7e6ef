#include "daemon/worker_pool.h"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace moesnap::daemon {

WorkerPool::WorkerPool(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void WorkerPool::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mutex_);
  tasks_.push_back(std::move(task));
}

void WorkerPool::SubmitAll(std::vector<std::function<void()>> tasks) {
  absl::MutexLock lock(&mutex_);
  for (std::function<void()>& task : tasks) tasks_.push_back(std::move(task));
}

void WorkerPool::Run() {
  // Bulk copies run only on CPU time nothing else wants (SCHED_IDLE): gRPC replies the trainer waits
  // on, and the trainer's own threads, always come first. A niced thread still took whole time slices
  // from the reply to a Snapshot on a 2-core machine (tails up to the capture time itself).
  sched_param parameters{};
  sched_setscheduler(static_cast<pid_t>(syscall(SYS_gettid)), SCHED_IDLE, &parameters);
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mutex_);
      mutex_.Await(absl::Condition(
          +[](WorkerPool* pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool->mutex_) {
            return pool->stopping_ || !pool->tasks_.empty();
          },
          this));
      if (tasks_.empty()) return;  // stopping, and nothing left to run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace moesnap::daemon
