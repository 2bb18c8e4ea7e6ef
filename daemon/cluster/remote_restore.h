// Remote (elastic) restore: a rank restores a region that another rank snapshotted on another
// node (an expert moved after failures). The node that holds it pushes it over the data plane, or,
// when that node is lost, the units covering the region are decoded from its group's survivors;
// every chunk's CRC-32C is checked as the bytes land.
#ifndef MOESNAP_DAEMON_CLUSTER_REMOTE_RESTORE_H_
#define MOESNAP_DAEMON_CLUSTER_REMOTE_RESTORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/rebuild.h"
#include "daemon/cluster/transfer.h"
#include "daemon/cluster_store.h"

namespace moesnap::daemon::cluster {

// Thread-safe.
class RemoteRestore {
 public:
  RemoteRestore(const ClusterContext& context, ClusterStore* store, Transfer* transfer,
                Rebuilder* rebuilder);

  // Restores into `rank` what `source_rank` snapshotted: from this node's committed state, else
  // from the node that holds it, else decoded from that node's group.
  absl::StatusOr<v1::RestoreResponse> RestoreFrom(uint32_t rank, uint32_t source_rank,
                                                  const std::vector<std::string>& regions);

  // The serving side: which node's committed image holds a rank, from this node's group record;
  // and a push of one committed region of this node to the asking node's data plane.
  v1::LocateRankResponse Locate(const v1::LocateRankRequest& request) const;
  absl::StatusOr<v1::SendRegionResponse> SendRegion(const v1::SendRegionRequest& request);

 private:
  const ClusterContext context_;
  ClusterStore* const store_;
  Transfer* const transfer_;
  Rebuilder* const rebuilder_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_REMOTE_RESTORE_H_
