// The cluster's answer to the durable tier (durable::JobView): whether this node's memory holds
// the committed state (its rebuild at start has ended without failing) and, for the other nodes,
// whether theirs does, asked over the Peer service (DurableState); the steps durable on every
// node, and this node's record of its own, in etcd (DurableRecords).
#ifndef MOESNAP_DAEMON_CLUSTER_DURABLE_VIEW_H_
#define MOESNAP_DAEMON_CLUSTER_DURABLE_VIEW_H_

#include "daemon/cluster/context.h"
#include "daemon/cluster/control.h"
#include "daemon/cluster/rebuild.h"
#include "daemon/cluster_store.h"
#include "daemon/durable/job_view.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

// Thread-safe.
class DurableView final : public durable::JobView {
 public:
  DurableView(const ClusterContext& context, const ClusterStore* store, Rebuilder* rebuilder,
              DurableRecords* records)
      : context_(context), store_(store), rebuilder_(rebuilder), records_(records) {}

  absl::Status WaitMemory(absl::Time deadline) override;
  durable::MemorySurvey SurveyMemory(absl::Time deadline) override;
  absl::StatusOr<durable::DurableEverywhere> NewestDurableEverywhere(
      const std::vector<int64_t>& here) override;
  absl::Status RecordDurable(const std::vector<int64_t>& here) override;
  void StateLoaded() override;
  // This node's answer to a peer's DurableState (the Peer service's handler takes a StatusOr).
  absl::StatusOr<v1::DurableStateResponse> Local() const;

 private:
  const ClusterContext context_;
  const ClusterStore* const store_;
  Rebuilder* const rebuilder_;
  DurableRecords* const records_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_DURABLE_VIEW_H_
