// Client: key-value, transactions, write-once, leases (grant, revoke), compaction and status, each
// a unary etcd RPC sent through Endpoints::Call. Keep-alives and watches are in lease_keeper.cc and
// watcher.cc.
#include "daemon/etcd/etcd_client.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/etcd/endpoints.h"
#include "daemon/etcd/wire.h"

namespace moesnap::etcd {
namespace {

using internal::Endpoint;
using internal::Retry;

// Keys are bytes; messages show them escaped.
std::string Quoted(const std::string& key) { return absl::StrCat("'", absl::CHexEscape(key), "'"); }

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const Options& options) {
  absl::StatusOr<std::shared_ptr<internal::Endpoints>> endpoints =
      internal::Endpoints::Create(options);
  if (!endpoints.ok()) return endpoints.status();
  return std::unique_ptr<Client>(new Client(*std::move(endpoints)));
}

Client::Client(std::shared_ptr<internal::Endpoints> endpoints) : endpoints_(std::move(endpoints)) {}
Client::~Client() = default;

const Options& Client::options() const { return endpoints_->options(); }

absl::StatusOr<std::optional<KeyValue>> Client::Get(const std::string& key) {
  const etcdserverpb::RangeRequest request = internal::RangeOf(key, /*prefix=*/false);
  etcdserverpb::RangeResponse response;
  const absl::Status status = endpoints_->Call(
      absl::StrCat("Get of ", Quoted(key)), Retry::kAlways, absl::Now() + options().call_timeout,
      [&](const Endpoint& endpoint, grpc::ClientContext& context) {
        return endpoint.kv->Range(&context, request, &response);
      });
  if (!status.ok()) return status;
  if (response.kvs().empty()) return std::nullopt;
  return internal::FromWire(response.kvs(0));
}

absl::StatusOr<RangeResult> Client::GetPrefix(const std::string& prefix,
                                              const RangeOptions& options) {
  const etcdserverpb::RangeRequest request = internal::RangeOf(prefix, options);
  etcdserverpb::RangeResponse response;
  const absl::Status status =
      endpoints_->Call(absl::StrCat("Get of prefix ", Quoted(prefix)), Retry::kAlways,
                       absl::Now() + this->options().call_timeout,
                       [&](const Endpoint& endpoint, grpc::ClientContext& context) {
                         return endpoint.kv->Range(&context, request, &response);
                       });
  if (!status.ok()) return status;
  RangeResult result{.revision = response.header().revision(), .more = response.more()};
  result.kvs.reserve(response.kvs_size());
  for (const mvccpb::KeyValue& kv : response.kvs()) result.kvs.push_back(internal::FromWire(kv));
  return result;
}

absl::StatusOr<int64_t> Client::Put(const std::string& key, const std::string& value,
                                    int64_t lease) {
  etcdserverpb::PutRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_lease(lease);
  etcdserverpb::PutResponse response;
  const absl::Status status =
      endpoints_->Call(absl::StrCat("Put of ", Quoted(key)), Retry::kOnlyIfNotApplied,
                       absl::Now() + options().call_timeout,
                       [&](const Endpoint& endpoint, grpc::ClientContext& context) {
                         return endpoint.kv->Put(&context, request, &response);
                       });
  if (!status.ok()) return status;
  return response.header().revision();
}

namespace {

absl::StatusOr<DeleteResult> DeleteRange(internal::Endpoints& endpoints, const std::string& key,
                                         bool prefix) {
  const etcdserverpb::DeleteRangeRequest request = internal::DeleteOf(key, prefix);
  etcdserverpb::DeleteRangeResponse response;
  const absl::Status status =
      endpoints.Call(absl::StrCat("Delete of ", prefix ? "prefix " : "", Quoted(key)),
                     Retry::kOnlyIfNotApplied, absl::Now() + endpoints.options().call_timeout,
                     [&](const Endpoint& endpoint, grpc::ClientContext& context) {
                       return endpoint.kv->DeleteRange(&context, request, &response);
                     });
  if (!status.ok()) return status;
  return DeleteResult{.deleted = response.deleted(), .revision = response.header().revision()};
}

}  // namespace

absl::StatusOr<DeleteResult> Client::Delete(const std::string& key) {
  return DeleteRange(*endpoints_, key, /*prefix=*/false);
}

absl::StatusOr<DeleteResult> Client::DeletePrefix(const std::string& prefix) {
  return DeleteRange(*endpoints_, prefix, /*prefix=*/true);
}

absl::StatusOr<TxnResult> Client::Txn(const TxnRequest& request) {
  const etcdserverpb::TxnRequest wire = internal::ToWire(request);
  etcdserverpb::TxnResponse response;
  const std::string first_key = request.compares.empty() ? std::string() : request.compares[0].key;
  const absl::Status status =
      endpoints_->Call(absl::StrCat("Txn (", request.compares.size(), " compares, first on ",
                                    Quoted(first_key), ")"),
                       request.safe_to_retry ? Retry::kAlways : Retry::kOnlyIfNotApplied,
                       absl::Now() + options().call_timeout,
                       [&](const Endpoint& endpoint, grpc::ClientContext& context) {
                         return endpoint.kv->Txn(&context, wire, &response);
                       });
  if (!status.ok()) return status;
  return internal::FromWire(response);
}

absl::StatusOr<KeyValue> Client::WriteOnce(const std::string& key, const std::string& value,
                                           const std::optional<Fence>& fence, int64_t lease) {
  // Absent key (and fence holding): put. Otherwise read the key and the fence key, to say which
  // compare failed. A resent attempt after an applied one finds the key: the same answer.
  TxnRequest request{.compares = {Compare::Absent(key)},
                     .on_success = {Operation::Put(key, value, lease)},
                     .on_failure = {Operation::Get(key)},
                     .safe_to_retry = true};
  if (fence.has_value()) {
    request.compares.push_back(
        Compare::CreateRevision(fence->key, Compare::Relation::kEqual, fence->create_revision));
    request.on_failure.push_back(Operation::Get(fence->key));
  }
  absl::StatusOr<TxnResult> result = Txn(request);
  if (!result.ok()) return result.status();
  if (result->succeeded) {
    return KeyValue{.key = key,
                    .value = value,
                    .create_revision = result->revision,
                    .mod_revision = result->revision,
                    .version = 1,
                    .lease = lease};
  }
  if (!result->results.empty() && !result->results[0].kvs.empty()) return result->results[0].kvs[0];
  const int64_t found = result->results.size() > 1 && !result->results[1].kvs.empty()
                            ? result->results[1].kvs[0].create_revision
                            : 0;
  return absl::FailedPreconditionError(absl::StrCat(
      "etcd WriteOnce of ", Quoted(key), " fenced off: ", Quoted(fence ? fence->key : ""),
      " has create revision ", found, found == 0 ? " (absent)" : "", ", the write needed ",
      fence ? fence->create_revision : 0));
}

absl::StatusOr<Lease> Client::GrantLease(absl::Duration ttl) {
  const int64_t seconds = absl::ToInt64Seconds(absl::Ceil(ttl, absl::Seconds(1)));
  if (seconds <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd lease TTL must be at least 1 s, got ", absl::FormatDuration(ttl)));
  }
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(seconds);
  etcdserverpb::LeaseGrantResponse response;
  // Resending may grant a second lease; nothing holds it and it expires after its TTL.
  const absl::Status status =
      endpoints_->Call(absl::StrCat("LeaseGrant of ", seconds, " s"), Retry::kAlways,
                       absl::Now() + options().call_timeout,
                       [&](const Endpoint& endpoint, grpc::ClientContext& context) {
                         return endpoint.lease->LeaseGrant(&context, request, &response);
                       });
  if (!status.ok()) return status;
  if (!response.error().empty()) {
    return absl::UnavailableError(
        absl::StrCat("etcd LeaseGrant of ", seconds, " s: ", response.error()));
  }
  return Lease{.id = response.id(), .ttl_seconds = response.ttl()};
}

absl::Status Client::RevokeLease(int64_t lease_id) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(lease_id);
  etcdserverpb::LeaseRevokeResponse response;
  const absl::Status status =
      endpoints_->Call(absl::StrCat("LeaseRevoke of lease ", lease_id), Retry::kAlways,
                       absl::Now() + options().call_timeout,
                       [&](const Endpoint& endpoint, grpc::ClientContext& context) {
                         return endpoint.lease->LeaseRevoke(&context, request, &response);
                       });
  // Gone already (expired, revoked, or revoked by an earlier attempt of this call).
  if (absl::IsNotFound(status)) return absl::OkStatus();
  return status;
}

absl::StatusOr<std::unique_ptr<LeaseKeeper>> Client::KeepAlive(
    const Lease& lease, std::function<void(const absl::Status&)> on_lost) {
  if (lease.id == 0 || lease.ttl_seconds <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("etcd KeepAlive needs a granted lease, got id ",
                                                   lease.id, " TTL ", lease.ttl_seconds, " s"));
  }
  return LeaseKeeper::Start(endpoints_, lease, std::move(on_lost));
}

absl::StatusOr<std::unique_ptr<Watcher>> Client::WatchKey(const std::string& key,
                                                          int64_t start_revision) {
  if (start_revision < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "etcd watch of ", Quoted(key), " needs a start revision >= 1, got ", start_revision));
  }
  return Watcher::Start(endpoints_, key, /*prefix=*/false, start_revision);
}

absl::StatusOr<std::unique_ptr<Watcher>> Client::WatchPrefix(const std::string& prefix,
                                                             int64_t start_revision) {
  if (start_revision < 1) {
    return absl::InvalidArgumentError(absl::StrCat("etcd watch of prefix ", Quoted(prefix),
                                                   " needs a start revision >= 1, got ",
                                                   start_revision));
  }
  return Watcher::Start(endpoints_, prefix, /*prefix=*/true, start_revision);
}

absl::Status Client::Compact(int64_t revision) {
  etcdserverpb::CompactionRequest request;
  request.set_revision(revision);
  etcdserverpb::CompactionResponse response;
  const absl::Status status =
      endpoints_->Call(absl::StrCat("Compact at revision ", revision), Retry::kAlways,
                       absl::Now() + options().call_timeout,
                       [&](const Endpoint& endpoint, grpc::ClientContext& context) {
                         return endpoint.kv->Compact(&context, request, &response);
                       });
  // An earlier compaction (perhaps this call's own first attempt) already covered the revision.
  if (absl::IsOutOfRange(status) &&
      status.message().find("required revision has been compacted") != std::string::npos) {
    return absl::OkStatus();
  }
  return status;
}

absl::StatusOr<MemberStatus> Client::Status() {
  etcdserverpb::StatusRequest request;
  etcdserverpb::StatusResponse response;
  std::string answered;
  const absl::Status status =
      endpoints_->Call("Status", Retry::kAlways, absl::Now() + options().call_timeout,
                       [&](const Endpoint& endpoint, grpc::ClientContext& context) {
                         answered = endpoint.address;
                         return endpoint.maintenance->Status(&context, request, &response);
                       });
  if (!status.ok()) return status;
  return MemberStatus{.endpoint = answered,
                      .member_id = response.header().member_id(),
                      .leader_id = response.leader(),
                      .raft_term = response.raftterm(),
                      .revision = response.header().revision(),
                      .version = response.version()};
}

}  // namespace moesnap::etcd
