// Conversions between the etcd client's public types and etcd's v3 API messages. Private to
// daemon/etcd/.
#ifndef MOESNAP_DAEMON_ETCD_WIRE_H_
#define MOESNAP_DAEMON_ETCD_WIRE_H_

#include <string>

#include "daemon/etcd/etcd_client.h"
#include "etcd/etcdserver/etcdserverpb/rpc.pb.h"

namespace moesnap::etcd::internal {

KeyValue FromWire(const mvccpb::KeyValue& kv);
WatchEvent FromWire(const mvccpb::Event& event);

// A read of one key, or with `prefix` of every key that starts with it.
etcdserverpb::RangeRequest RangeOf(const std::string& key, bool prefix);
etcdserverpb::RangeRequest RangeOf(const std::string& prefix, const RangeOptions& options);
etcdserverpb::DeleteRangeRequest DeleteOf(const std::string& key, bool prefix);

etcdserverpb::Compare ToWire(const Compare& compare);
etcdserverpb::RequestOp ToWire(const Operation& operation);
etcdserverpb::TxnRequest ToWire(const TxnRequest& request);
// The result of a transaction: one OperationResult per operation of the branch that ran.
TxnResult FromWire(const etcdserverpb::TxnResponse& response);

}  // namespace moesnap::etcd::internal

#endif  // MOESNAP_DAEMON_ETCD_WIRE_H_
