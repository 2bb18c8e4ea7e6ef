// A node's part in every step's commit. Once its trainers have captured a step it proposes the step
// to the coordinator; then, asked by the coordinator:
//   Prepare  waits until its trainers captured the step and reports its image (NodeImage);
//   Encode   opens its parity units of the step, sends each of its data units (or, for a step that
//            keeps every node's layout, the deltas of the changed ones) to the stripe's m parity
//            holders, and answers once every unit it holds has received all its data;
//   Commit   journals the step (its versions, its group's images, its parity) and frees the
//            previous step; or Abort, and the step is forgotten with the previous one intact.
#ifndef MOESNAP_DAEMON_CLUSTER_PARTICIPANT_H_
#define MOESNAP_DAEMON_CLUSTER_PARTICIPANT_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/membership.h"
#include "daemon/cluster/rebuild.h"
#include "daemon/cluster/transfer.h"
#include "daemon/cluster_store.h"
#include "daemon/parity_store.h"

namespace moesnap::daemon::cluster {

// A step prepared here and neither committed nor aborted yet.
struct OpenStepView {
  int64_t step = 0;
  uint32_t coordinator = 0;
  bool encoded = false;
};

// Thread-safe.
class Participant {
 public:
  Participant(const ClusterContext& context, ClusterStore* store, ParityStore* parity,
              Transfer* transfer, const Rebuilder* rebuilder, const Membership* membership);
  ~Participant();  // stops proposing

  // Starts proposing every step this node's trainers capture.
  void Start();

  absl::StatusOr<v1::PrepareResponse> Prepare(const v1::PrepareRequest& request);
  absl::StatusOr<v1::EncodeResponse> Encode(const v1::EncodeRequest& request);
  absl::Status Commit(const v1::CommitRequest& request);
  absl::Status Abort(const v1::AbortRequest& request);
  v1::StepOutcomeResponse StepOutcome(const v1::StepOutcomeRequest& request) const;

  // Open steps, oldest first.
  std::vector<OpenStepView> OpenSteps() const;
  // Why the latest aborted step failed ("step S: reason"), if any.
  std::string last_abort() const;
  uint64_t full_encodes() const { return full_encodes_; }
  uint64_t delta_encodes() const { return delta_encodes_; }
  uint64_t parity_bytes_sent() const { return parity_bytes_sent_; }

 private:
  struct OpenStep {
    uint32_t coordinator = 0;
    NodeImage image;
    std::vector<v1::NodeImage> group_images;
    bool encoded = false;
  };
  void ProposeLoop();
  // Proposes `step` to the coordinator until it takes it or the commit timeout passes.
  void Propose(int64_t step);
  bool stopping() const;

  const ClusterContext context_;
  ClusterStore* const store_;
  ParityStore* const parity_;
  Transfer* const transfer_;
  const Rebuilder* const rebuilder_;
  const Membership* const membership_;

  std::atomic<uint64_t> full_encodes_{0};
  std::atomic<uint64_t> delta_encodes_{0};
  std::atomic<uint64_t> parity_bytes_sent_{0};

  mutable absl::Mutex mutex_;
  absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::map<int64_t, OpenStep> open_ ABSL_GUARDED_BY(mutex_);
  std::string last_abort_ ABSL_GUARDED_BY(mutex_);
  std::thread proposer_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_PARTICIPANT_H_
