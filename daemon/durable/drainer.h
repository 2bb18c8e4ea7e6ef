// The drain: writes the committed state of this node's ranks from the pool to disk, in the
// background, for the steps the schedule makes due. It is told of each commit by the store (under
// the store's lock: it only decides and queues), holds the image of the step it drains by
// reference so no commit can free those versions underneath it, and never makes a commit wait:
// a step that comes due while the previous one is still being written is skipped (and counted).
// At most one image is held at a time, so the pool needs room for one more committed state while
// a drain runs. A failed drain (disk full, a folder it cannot write, a slow disk stopped by
// shutdown) is logged and shown in Status; training goes on and every complete step stays.
// After each complete step, steps beyond the newest `keep` are deleted, except the newest step
// durable on every node of the job; then the steps left on disk are recorded for the job (the
// view's RecordDurable: one record per completed drain, and one per deletion of an abandoned
// run's steps), and only recorded steps count as durable on every node.
#ifndef MOESNAP_DAEMON_DURABLE_DRAINER_H_
#define MOESNAP_DAEMON_DURABLE_DRAINER_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/durable/clock.h"
#include "daemon/durable/drain_schedule.h"
#include "daemon/durable/durable_directory.h"
#include "daemon/durable/durable_options.h"
#include "daemon/durable/job_view.h"
#include "daemon/durable/step_writer.h"
#include "daemon/durable_store.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::durable {

// Thread-safe. `store`, `view` and `clock` must outlive it.
class Drainer final : public DurableStore::CommitObserver {
 public:
  Drainer(const DurableOptions& options, const StepIdentity& identity, DurableStore* store,
          JobView* view, Clock* clock);
  // Stops observing the store and stops the drain (a step half written is removed).
  ~Drainer() override;

  // Prepares the folder (a failure is logged and shown in Status; drains retry it) and starts
  // observing commits.
  void Start();

  void Committed(std::optional<int64_t> previous, int64_t step,
                 const std::function<NodeImage()>& image) override;

  v1::DurableStatus Status() const;
  const DurableDirectory& directory() const { return directory_; }
  // Deletes every complete step after `step`: a restore from `step` abandons the run that wrote
  // them, and they must never be taken for that run's continuation.
  absl::Status DiscardAfter(int64_t step);
  // Blocks until no drain is queued or running (benchmarks, tests). False at `deadline`.
  bool WaitIdle(absl::Time deadline) const;

 private:
  void Run();
  void Drain(int64_t step, const NodeImage& image);
  // Deletes complete steps beyond `keep`, sparing the newest durable on every node.
  void Retain();
  // Records the complete steps on disk with the view; a failure is logged and shown in Status.
  void Record() ABSL_LOCKS_EXCLUDED(record_mutex_, mutex_);

  const DurableOptions options_;
  const StepIdentity identity_;
  const DrainSchedule schedule_;
  const DurableDirectory directory_;
  DurableStore* const store_;
  JobView* const view_;
  Clock* const clock_;

  std::atomic<uint64_t> written_{0};
  std::atomic<bool> stop_{false};

  // One record at a time, each listing the disk as it is when written: a later record never
  // carries an older listing.
  absl::Mutex record_mutex_ ABSL_ACQUIRED_BEFORE(mutex_);
  mutable absl::Mutex mutex_;
  mutable absl::CondVar wake_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  bool started_ ABSL_GUARDED_BY(mutex_) = false;
  std::optional<std::pair<int64_t, NodeImage>> pending_ ABSL_GUARDED_BY(mutex_);
  absl::Time last_commit_ ABSL_GUARDED_BY(mutex_);
  v1::DurableStatus status_ ABSL_GUARDED_BY(mutex_);
  // The newest step last found durable on every node; retention never deletes it.
  std::optional<int64_t> durable_everywhere_ ABSL_GUARDED_BY(mutex_);
  std::thread thread_;
};

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_DRAINER_H_
