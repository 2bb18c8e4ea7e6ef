// What this node tells operators and peers about itself: its committed step, its memory, whether
// it is behind its group, and its open step.
#ifndef MOESNAP_DAEMON_CLUSTER_LOCAL_REPORT_H_
#define MOESNAP_DAEMON_CLUSTER_LOCAL_REPORT_H_

#include "daemon/cluster/context.h"
#include "daemon/cluster/participant.h"
#include "daemon/cluster/rebuild.h"
#include "daemon/cluster/remote_restore.h"
#include "daemon/cluster_store.h"
#include "daemon/parity_store.h"
#include "daemon/pool.h"

namespace moesnap::daemon::cluster {

// Thread-safe; reads only.
class LocalReport {
 public:
  LocalReport(const ClusterContext& context, const ClusterStore* store, const ParityStore* parity,
              const Pool* pool, const Rebuilder* rebuilder, const Participant* participant,
              const RemoteRestore* remote_restore);

  v1::NodeMemory Memory() const;
  v1::NodeReport Describe() const;

 private:
  const ClusterContext context_;
  const ClusterStore* const store_;
  const ParityStore* const parity_;
  const Pool* const pool_;
  const Rebuilder* const rebuilder_;
  const Participant* const participant_;
  const RemoteRestore* const remote_restore_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_LOCAL_REPORT_H_
