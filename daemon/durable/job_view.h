// What the nodes of the job can restore from, as this node learns it: whether each node's memory
// holds the committed state (asked of the peers), and the newest step durable on every node (from
// where the cluster records it: each node's record of its durable steps, in etcd beside the step
// decisions). The durable tier asks this view and tells it what this node's disk holds; the
// cluster answers it (on a single node there is nobody else to ask).
#ifndef MOESNAP_DAEMON_DURABLE_JOB_VIEW_H_
#define MOESNAP_DAEMON_DURABLE_JOB_VIEW_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moesnap::daemon::durable {

struct NodeMemory {
  uint32_t node_id = 0;
  // The committed step it restores from memory; absent when its memory holds none (a fresh pool,
  // a rebuild that could not recover its data).
  std::optional<int64_t> memory_step;
  bool settled = true;  // false while it still rebuilds from its group
};

struct MemorySurvey {
  std::vector<NodeMemory> answered;
  std::map<uint32_t, std::string> silent;  // the peers that did not answer, and why
};

// The newest step durable on every node of the job, and why that one (or why none).
struct DurableEverywhere {
  std::optional<int64_t> step;
  std::string reason;
};

// Thread-safe.
class JobView {
 public:
  virtual ~JobView() = default;
  // Waits until this node knows whether its memory holds the committed state (a replacement's
  // rebuild has ended): OK when it does, or why not (the rebuild's failure). UNAVAILABLE while it
  // still rebuilds at `deadline`.
  virtual absl::Status WaitMemory(absl::Time deadline) = 0;
  // Whether every other node's memory holds the committed state, asked in parallel until
  // `deadline`.
  virtual MemorySurvey SurveyMemory(absl::Time deadline) = 0;
  // The newest step durable on every node, as recorded; `here` is what this node's disk holds.
  // UNAVAILABLE when the records cannot be read now.
  virtual absl::StatusOr<DurableEverywhere> NewestDurableEverywhere(
      const std::vector<int64_t>& here) = 0;
  // Records the steps complete on this node's disk (after each completed drain and each deletion).
  virtual absl::Status RecordDurable(const std::vector<int64_t>& here) = 0;
  // A rank's state was loaded from the durable tier into this node's memory: whatever memory could
  // not recover before (a failed rebuild) is replaced by it.
  virtual void StateLoaded() = 0;
};

// A single node: its memory is what it is, it has no peers, and its disk is the job's.
class SingleNodeView final : public JobView {
 public:
  absl::Status WaitMemory(absl::Time) override { return absl::OkStatus(); }
  MemorySurvey SurveyMemory(absl::Time) override { return {}; }
  absl::StatusOr<DurableEverywhere> NewestDurableEverywhere(
      const std::vector<int64_t>& here) override {
    if (here.empty()) return DurableEverywhere{std::nullopt, "this node has no durable step"};
    return DurableEverywhere{here.back(), "the newest durable step of this node, the job's only one"};
  }
  absl::Status RecordDurable(const std::vector<int64_t>&) override { return absl::OkStatus(); }
  void StateLoaded() override {}
};

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_JOB_VIEW_H_
