// The decision log and the leadership on etcd: decisions are write-once keys written in a
// transaction that also requires the coordinator's leader key to have the create revision of its
// fencing token; leadership is etcd's election recipe over this node's lease.
#ifndef MOESNAP_DAEMON_CLUSTER_ETCD_CONTROL_H_
#define MOESNAP_DAEMON_CLUSTER_ETCD_CONTROL_H_

#include <memory>

#include "daemon/cluster/control.h"
#include "daemon/cluster/etcd_keys.h"
#include "daemon/cluster/etcd_session.h"

namespace moesnap::daemon::cluster {

// `session` must outlive what these return.
std::unique_ptr<DecisionLog> NewEtcdDecisionLog(EtcdSession* session, const EtcdKeys& keys,
                                                uint32_t node_id);
std::unique_ptr<Leadership> NewEtcdLeadership(EtcdSession* session, const EtcdKeys& keys,
                                              uint32_t node_id);

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_ETCD_CONTROL_H_
