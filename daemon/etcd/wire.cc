// Public types <-> etcd's v3 API messages.
#include "daemon/etcd/wire.h"

namespace moesnap::etcd {

std::string PrefixRangeEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

namespace internal {
namespace {

etcdserverpb::Compare::CompareResult ToWire(Compare::Relation relation) {
  switch (relation) {
    case Compare::Relation::kEqual:
      return etcdserverpb::Compare::EQUAL;
    case Compare::Relation::kNotEqual:
      return etcdserverpb::Compare::NOT_EQUAL;
    case Compare::Relation::kLess:
      return etcdserverpb::Compare::LESS;
    case Compare::Relation::kGreater:
      return etcdserverpb::Compare::GREATER;
  }
  return etcdserverpb::Compare::EQUAL;
}

// etcd reads every key when both key and range end are "\0"; an empty prefix means that.
void SetRange(const std::string& key, bool prefix, std::string* wire_key, std::string* range_end) {
  if (!prefix) {
    *wire_key = key;
    return;
  }
  *wire_key = key.empty() ? std::string(1, '\0') : key;
  *range_end = PrefixRangeEnd(key);
}

}  // namespace

KeyValue FromWire(const mvccpb::KeyValue& kv) {
  return KeyValue{.key = kv.key(),
                  .value = kv.value(),
                  .create_revision = kv.create_revision(),
                  .mod_revision = kv.mod_revision(),
                  .version = kv.version(),
                  .lease = kv.lease()};
}

WatchEvent FromWire(const mvccpb::Event& event) {
  return WatchEvent{.type = event.type() == mvccpb::Event::DELETE ? WatchEvent::Type::kDelete
                                                                  : WatchEvent::Type::kPut,
                    .kv = FromWire(event.kv())};
}

etcdserverpb::RangeRequest RangeOf(const std::string& key, bool prefix) {
  etcdserverpb::RangeRequest range;
  SetRange(key, prefix, range.mutable_key(), range.mutable_range_end());
  return range;
}

etcdserverpb::RangeRequest RangeOf(const std::string& prefix, const RangeOptions& options) {
  etcdserverpb::RangeRequest range = RangeOf(prefix, /*prefix=*/true);
  range.set_limit(options.limit);
  range.set_max_create_revision(options.max_create_revision);
  range.set_revision(options.revision);
  if (options.order != RangeOptions::Order::kKey) {
    range.set_sort_target(etcdserverpb::RangeRequest::CREATE);
    range.set_sort_order(options.order == RangeOptions::Order::kCreateAscending
                             ? etcdserverpb::RangeRequest::ASCEND
                             : etcdserverpb::RangeRequest::DESCEND);
  }
  return range;
}

etcdserverpb::DeleteRangeRequest DeleteOf(const std::string& key, bool prefix) {
  etcdserverpb::DeleteRangeRequest deletion;
  SetRange(key, prefix, deletion.mutable_key(), deletion.mutable_range_end());
  return deletion;
}

etcdserverpb::Compare ToWire(const Compare& compare) {
  etcdserverpb::Compare wire;
  wire.set_key(compare.key);
  wire.set_result(ToWire(compare.relation));
  switch (compare.target) {
    case Compare::Target::kValue:
      wire.set_target(etcdserverpb::Compare::VALUE);
      wire.set_value(compare.value);
      break;
    case Compare::Target::kVersion:
      wire.set_target(etcdserverpb::Compare::VERSION);
      wire.set_version(compare.number);
      break;
    case Compare::Target::kCreateRevision:
      wire.set_target(etcdserverpb::Compare::CREATE);
      wire.set_create_revision(compare.number);
      break;
    case Compare::Target::kModRevision:
      wire.set_target(etcdserverpb::Compare::MOD);
      wire.set_mod_revision(compare.number);
      break;
  }
  return wire;
}

etcdserverpb::RequestOp ToWire(const Operation& operation) {
  etcdserverpb::RequestOp wire;
  switch (operation.kind) {
    case Operation::Kind::kGet:
      *wire.mutable_request_range() = RangeOf(operation.key, operation.prefix);
      break;
    case Operation::Kind::kPut: {
      etcdserverpb::PutRequest* put = wire.mutable_request_put();
      put->set_key(operation.key);
      put->set_value(operation.value);
      put->set_lease(operation.lease);
      break;
    }
    case Operation::Kind::kDelete:
      *wire.mutable_request_delete_range() = DeleteOf(operation.key, operation.prefix);
      if (!operation.prefix && !operation.range_end.empty()) {
        wire.mutable_request_delete_range()->set_range_end(operation.range_end);
      }
      break;
  }
  return wire;
}

etcdserverpb::TxnRequest ToWire(const TxnRequest& request) {
  etcdserverpb::TxnRequest wire;
  for (const Compare& compare : request.compares) *wire.add_compare() = ToWire(compare);
  for (const Operation& operation : request.on_success) *wire.add_success() = ToWire(operation);
  for (const Operation& operation : request.on_failure) *wire.add_failure() = ToWire(operation);
  return wire;
}

TxnResult FromWire(const etcdserverpb::TxnResponse& response) {
  TxnResult result{.succeeded = response.succeeded(), .revision = response.header().revision()};
  for (const etcdserverpb::ResponseOp& op : response.responses()) {
    OperationResult& one = result.results.emplace_back();
    if (op.has_response_range()) {
      for (const mvccpb::KeyValue& kv : op.response_range().kvs()) one.kvs.push_back(FromWire(kv));
    } else if (op.has_response_delete_range()) {
      one.deleted = op.response_delete_range().deleted();
    }
  }
  return result;
}

}  // namespace internal

Compare Compare::Absent(std::string key) {
  return CreateRevision(std::move(key), Relation::kEqual, 0);
}
Compare Compare::CreateRevision(std::string key, Relation relation, int64_t revision) {
  return Compare{.key = std::move(key),
                 .target = Target::kCreateRevision,
                 .relation = relation,
                 .number = revision};
}
Compare Compare::ModRevision(std::string key, Relation relation, int64_t revision) {
  return Compare{.key = std::move(key),
                 .target = Target::kModRevision,
                 .relation = relation,
                 .number = revision};
}
Compare Compare::Version(std::string key, Relation relation, int64_t version) {
  return Compare{
      .key = std::move(key), .target = Target::kVersion, .relation = relation, .number = version};
}
Compare Compare::Value(std::string key, Relation relation, std::string value) {
  return Compare{.key = std::move(key),
                 .target = Target::kValue,
                 .relation = relation,
                 .value = std::move(value)};
}

Operation Operation::Get(std::string key) {
  return Operation{.kind = Kind::kGet, .key = std::move(key)};
}
Operation Operation::GetPrefix(std::string prefix) {
  return Operation{.kind = Kind::kGet, .key = std::move(prefix), .prefix = true};
}
Operation Operation::Put(std::string key, std::string value, int64_t lease) {
  return Operation{
      .kind = Kind::kPut, .key = std::move(key), .value = std::move(value), .lease = lease};
}
Operation Operation::Delete(std::string key) {
  return Operation{.kind = Kind::kDelete, .key = std::move(key)};
}
Operation Operation::DeletePrefix(std::string prefix) {
  return Operation{.kind = Kind::kDelete, .key = std::move(prefix), .prefix = true};
}
Operation Operation::DeleteRange(std::string key, std::string range_end) {
  return Operation{.kind = Kind::kDelete, .key = std::move(key), .range_end = std::move(range_end)};
}

}  // namespace moesnap::etcd
