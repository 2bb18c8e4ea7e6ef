// The coordinator's rounds: for each step a node proposes, a two-phase commit across every node
// (prepare and encode everywhere, then commit everywhere; abort if any node fails either). It runs
// on every node and acts while its node is the coordinator (membership says which).
//
// A node commits only after every node has encoded, so if the coordinator dies the next one
// finishes the open step: commit if any node committed it or every live node encoded it, abort
// otherwise (then no node can have committed it).
#ifndef MOESNAP_DAEMON_CLUSTER_COORDINATOR_H_
#define MOESNAP_DAEMON_CLUSTER_COORDINATOR_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/membership.h"
#include "daemon/cluster/participant.h"

namespace moesnap::daemon::cluster {

// Thread-safe.
class Coordinator {
 public:
  // `local` is this node's participant (its open steps count when finishing a lost coordinator's).
  Coordinator(const ClusterContext& context, const Membership* membership,
              const Participant* local);
  ~Coordinator();  // stops after the round in progress

  void Start();

  // A node captured `step`: its round starts unless it already ran.
  absl::StatusOr<v1::ProposeResponse> Propose(const v1::ProposeRequest& request);

  // Fault injection: as coordinator of the first step at or after `step` that reaches its commit,
  // commit it on the first half of the nodes and SIGKILL this process. "At or after": an earlier
  // step aborted by a slow start must not skip the fault.
  void set_crash_in_commit(int64_t step) { crash_in_commit_ = step; }

 private:
  void Loop();
  void RunRound(int64_t step);
  // Open steps whose coordinator is gone: finished from what the nodes report.
  void ResolveOrphans();
  absl::Status SendAbort(uint32_t id, int64_t step, const std::string& reason);
  absl::Status SendCommit(uint32_t id, int64_t step);

  const ClusterContext context_;
  const Membership* const membership_;
  const Participant* const local_;
  std::atomic<int64_t> crash_in_commit_{-1};

  absl::Mutex mutex_;
  absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::set<int64_t> proposed_ ABSL_GUARDED_BY(mutex_);  // steps awaiting a round
  std::optional<int64_t> last_round_ ABSL_GUARDED_BY(mutex_);
  std::optional<int64_t> running_round_ ABSL_GUARDED_BY(mutex_);
  std::set<int64_t> resolved_orphans_ ABSL_GUARDED_BY(mutex_);
  std::thread loop_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_COORDINATOR_H_
