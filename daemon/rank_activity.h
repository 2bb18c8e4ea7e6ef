// Which ranks of this node take part in its cluster steps. A step commits on a node once every rank
// with a trainer captured it, so one trainer that registered and stopped snapshotting (hung, or
// stuck outside training) would stall every step of the node. A rank that has not snapshotted for
// the idle timeout (capture.idle_rank_timeout_ms), or that an operator dropped (moesnapctl
// drop-rank), is left out of the node's steps until its next Snapshot, which brings it back.
#ifndef MOESNAP_DAEMON_RANK_ACTIVITY_H_
#define MOESNAP_DAEMON_RANK_ACTIVITY_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace moesnap::daemon {

// Thread-safe.
class RankActivity {
 public:
  // absl::ZeroDuration(): no rank is ever idle.
  explicit RankActivity(absl::Duration idle_timeout) : idle_timeout_(idle_timeout) {}

  // The rank's trainer connected, registered or snapshotted: it takes part again.
  void Active(uint32_t rank);
  // The rank's trainer disconnected: nothing of it to wait for, nor to watch.
  void Gone(uint32_t rank);
  // An operator leaves the rank out of the node's steps until its next Snapshot.
  void Drop(uint32_t rank);
  // Why the rank is left out of steps now, if it is. A rank found idle for the first time is
  // logged and counted (moesnap_ranks_dropped_total).
  std::optional<std::string> LeftOut(uint32_t rank);
  // When the next rank taking part turns idle, if that is still ahead: a wait for the node's steps
  // wakes then.
  std::optional<absl::Time> NextIdleAt() const;
  // Every rank left out now, with why.
  std::map<uint32_t, std::string> Dropped() const;

 private:
  struct State {
    absl::Time last_active;
    std::optional<std::string> dropped;  // why it is left out
  };

  const absl::Duration idle_timeout_;
  mutable absl::Mutex mutex_;
  std::map<uint32_t, State> ranks_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_RANK_ACTIVITY_H_
