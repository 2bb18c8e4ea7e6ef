// What the nodes of the job can restore from, as this node learns it: for each node, the steps
// complete on its disk and whether its memory holds the committed state. A step is durable for
// the job only when it is durable on every node; the durable tier asks this view, and the cluster
// answers it (on a single node there is nobody else to ask).
//
// Today the cluster answers by asking every peer over the Peer service (DurableState). When the
// cluster's decisions move to etcd, "node N has step S durable" belongs there, and only the
// cluster's implementation of this interface changes.
#ifndef MOESNAP_DAEMON_DURABLE_JOB_VIEW_H_
#define MOESNAP_DAEMON_DURABLE_JOB_VIEW_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace moesnap::daemon::durable {

struct NodeDurability {
  uint32_t node_id = 0;
  std::vector<int64_t> durable_steps;  // complete on its disk, oldest first
  // The committed step it restores from memory; absent when its memory holds none (a fresh pool,
  // a rebuild that could not recover its data).
  std::optional<int64_t> memory_step;
  bool settled = true;  // false while it still rebuilds from its group
};

struct PeerSurvey {
  std::vector<NodeDurability> answered;
  std::map<uint32_t, std::string> silent;  // the peers that did not answer, and why
};

// Thread-safe.
class JobView {
 public:
  virtual ~JobView() = default;
  // Waits until this node knows whether its memory holds the committed state (a replacement's
  // rebuild has ended): OK when it does, or why not (the rebuild's failure). UNAVAILABLE while it
  // still rebuilds at `deadline`.
  virtual absl::Status WaitMemory(absl::Time deadline) = 0;
  // Every other node of the job, asked in parallel until `deadline`.
  virtual PeerSurvey SurveyPeers(absl::Time deadline) = 0;
  // A rank's state was loaded from the durable tier into this node's memory: whatever memory could
  // not recover before (a failed rebuild) is replaced by it.
  virtual void StateLoaded() = 0;
};

// A single node: its memory is what it is, and it has no peers.
class SingleNodeView final : public JobView {
 public:
  absl::Status WaitMemory(absl::Time) override { return absl::OkStatus(); }
  PeerSurvey SurveyPeers(absl::Time) override { return {}; }
  void StateLoaded() override {}
};

// The newest step in every list (absent when they share none, or when there are none).
std::optional<int64_t> NewestCommonStep(const std::vector<const std::vector<int64_t>*>& lists);

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_JOB_VIEW_H_
