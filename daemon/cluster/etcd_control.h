// The decision log, the durable records and the leadership on etcd: decisions are write-once keys
// written in a transaction that also requires the coordinator's leader key to have the create
// revision of its fencing token; a node's durable record is written in a transaction that requires
// the node's member key to have this daemon's incarnation (and under no lease, so that it outlives
// a power loss of every node); leadership is etcd's election recipe over this node's lease.
#ifndef MOESNAP_DAEMON_CLUSTER_ETCD_CONTROL_H_
#define MOESNAP_DAEMON_CLUSTER_ETCD_CONTROL_H_

#include <memory>

#include "daemon/cluster/control.h"
#include "daemon/cluster/etcd_keys.h"
#include "daemon/cluster/etcd_session.h"
#include "daemon/cluster/membership.h"

namespace moesnap::daemon::cluster {

// `session` must outlive what these return.
std::unique_ptr<DecisionLog> NewEtcdDecisionLog(EtcdSession* session, const EtcdKeys& keys,
                                                uint32_t node_id);
// Records fenced by this node's member key (`membership` says whether this daemon holds it).
std::unique_ptr<DurableRecords> NewEtcdDurableRecords(EtcdSession* session, const EtcdKeys& keys,
                                                      const ClusterOptions& options,
                                                      uint32_t node_id,
                                                      const Membership* membership);
std::unique_ptr<Leadership> NewEtcdLeadership(EtcdSession* session, const EtcdKeys& keys,
                                              uint32_t node_id);

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_ETCD_CONTROL_H_
