// The cluster's answer to the durable tier (durable::JobView): whether this node's memory holds
// the committed state (its rebuild at start has ended without failing), and, for the other nodes,
// the steps durable on their disks and whether their memory holds the committed state, asked
// over the Peer service (DurableState). When the cluster's decisions move to etcd, "node N has
// step S durable" belongs there as one small key per node, and only this unit changes.
#ifndef MOESNAP_DAEMON_CLUSTER_DURABLE_VIEW_H_
#define MOESNAP_DAEMON_CLUSTER_DURABLE_VIEW_H_

#include "daemon/cluster/context.h"
#include "daemon/cluster/rebuild.h"
#include "daemon/cluster_store.h"
#include "daemon/durable/durable_directory.h"
#include "daemon/durable/job_view.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

// Thread-safe.
class DurableView final : public durable::JobView {
 public:
  // `durable` null: this node has no durable tier (it reports no durable step).
  DurableView(const ClusterContext& context, const ClusterStore* store, Rebuilder* rebuilder,
              const durable::DurableDirectory* durable)
      : context_(context), store_(store), rebuilder_(rebuilder), durable_(durable) {}

  absl::Status WaitMemory(absl::Time deadline) override;
  durable::PeerSurvey SurveyPeers(absl::Time deadline) override;
  void StateLoaded() override;
  // This node's answer to a peer's DurableState.
  absl::StatusOr<v1::DurableStateResponse> Local() const;

 private:
  const ClusterContext context_;
  const ClusterStore* const store_;
  Rebuilder* const rebuilder_;
  const durable::DurableDirectory* const durable_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_DURABLE_VIEW_H_
