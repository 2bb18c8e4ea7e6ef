// EtcdDecisionLog and EtcdLeadership.
#include "daemon/cluster/etcd_control.h"

#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/cluster/durable_records.h"
#include "daemon/etcd/election.h"

namespace moesnap::daemon::cluster {
namespace {

std::string CandidateName(uint32_t node_id) { return absl::StrCat(node_id); }

class EtcdDecisionLog final : public DecisionLog {
 public:
  EtcdDecisionLog(EtcdSession* session, const EtcdKeys& keys, uint32_t node_id)
      : session_(session), keys_(keys),
        fence_key_(absl::StrCat(keys.Leader(), "/", CandidateName(node_id))) {}

  absl::StatusOr<v1::StepDecision> Decide(const v1::StepDecision& decision) override {
    session_->CountWrite();
    absl::StatusOr<etcd::KeyValue> stored = session_->client().WriteOnce(
        keys_.Step(decision.step()), decision.SerializeAsString(),
        etcd::Fence{.key = fence_key_, .create_revision = decision.token()});
    session_->Note(stored.status());
    if (!stored.ok()) return stored.status();
    return Parse(*stored);
  }

  absl::StatusOr<std::vector<v1::StepDecision>> DecisionsAfter(
      std::optional<int64_t> after) override {
    absl::StatusOr<etcd::RangeResult> read = session_->client().GetPrefix(keys_.Steps());
    session_->Note(read.status());
    if (!read.ok()) return read.status();
    std::vector<v1::StepDecision> decisions;
    for (const etcd::KeyValue& kv : read->kvs) {  // in key order, which is step order
      absl::StatusOr<v1::StepDecision> decision = Parse(kv);
      if (!decision.ok()) return decision.status();
      if (!after || decision->step() > *after) decisions.push_back(*std::move(decision));
    }
    return decisions;
  }

  absl::Status ForgetBefore(int64_t step, int64_t token) override {
    session_->CountWrite();
    absl::StatusOr<etcd::TxnResult> result = session_->client().Txn(etcd::TxnRequest{
        .compares = {etcd::Compare::CreateRevision(fence_key_, etcd::Compare::Relation::kEqual,
                                                   token)},
        .on_success = {etcd::Operation::DeleteRange(keys_.Steps(), keys_.Step(step))},
        .safe_to_retry = true});
    session_->Note(result.status());
    if (!result.ok()) return result.status();
    if (!result->succeeded) {
      return absl::FailedPreconditionError(absl::StrCat(
          "decisions before step ", step, " not dropped: the leadership of token ", token,
          " is gone"));
    }
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<v1::StepDecision> Parse(const etcd::KeyValue& kv) const {
    v1::StepDecision decision;
    const std::optional<int64_t> step = keys_.StepOf(kv.key);
    if (!step || !decision.ParseFromString(kv.value) || decision.step() != *step) {
      return absl::DataLossError(absl::StrCat("etcd key ", kv.key,
                                              " does not hold a decision of its step"));
    }
    return decision;
  }

  EtcdSession* const session_;
  const EtcdKeys keys_;
  const std::string fence_key_;
};

class EtcdDurableRecords final : public DurableRecords {
 public:
  EtcdDurableRecords(EtcdSession* session, const EtcdKeys& keys, const ClusterOptions& options,
                     uint32_t node_id, const Membership* membership)
      : session_(session), keys_(keys),
        layout_{.node_count = options.node_count, .cluster_digest = options.Digest()},
        node_id_(node_id), membership_(membership) {}

  absl::Status Record(const std::vector<int64_t>& steps) override {
    if (!membership_->WaitRegistered(absl::Now() + kRegistrationWait)) {
      return absl::UnavailableError(absl::StrCat(
          "node ", node_id_, " is not registered in etcd now, so it cannot record its durable steps"));
    }
    const std::optional<int64_t> incarnation = membership_->incarnation();
    if (!incarnation) {
      return absl::UnavailableError(absl::StrCat("node ", node_id_, " lost its registration"));
    }
    session_->CountWrite();
    absl::StatusOr<etcd::TxnResult> result = session_->client().Txn(etcd::TxnRequest{
        .compares = {etcd::Compare::CreateRevision(keys_.Member(node_id_),
                                                   etcd::Compare::Relation::kEqual, *incarnation)},
        .on_success = {etcd::Operation::Put(keys_.Durable(node_id_),
                                            DurableRecordValue(node_id_, layout_.cluster_digest,
                                                               steps))},
        .safe_to_retry = true});
    session_->Note(result.status());
    if (!result.ok()) return result.status();
    if (!result->succeeded) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node ", node_id_, "'s member key is no longer this daemon's (incarnation ",
          *incarnation, "): its durable steps are not recorded"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<durable::DurableEverywhere> NewestEverywhere() override {
    absl::StatusOr<etcd::RangeResult> records = ReadRecords();
    if (!records.ok()) return records.status();
    absl::StatusOr<etcd::RangeResult> decisions = session_->client().GetPrefix(
        keys_.Steps(), {.limit = kMaxDecisionKeys, .revision = records->revision});
    session_->Note(decisions.status());
    if (!decisions.ok()) return decisions.status();
    if (decisions->more) {
      return absl::FailedPreconditionError(absl::StrCat(
          "etcd holds more than ", kMaxDecisionKeys, " step decisions under ", keys_.Steps()));
    }
    return NewestDurableEverywhere(keys_, layout_, records->kvs, decisions->kvs);
  }

  absl::StatusOr<std::optional<int64_t>> OldestRecorded() override {
    absl::StatusOr<etcd::RangeResult> records = ReadRecords();
    if (!records.ok()) return records.status();
    return OldestRecordedStep(keys_, layout_, records->kvs);
  }

 private:
  absl::StatusOr<etcd::RangeResult> ReadRecords() {
    // One key per node, and some room for keys that are not a node's (they are ignored).
    const int64_t record_limit = int64_t{layout_.node_count} + kExtraRecordKeys;
    absl::StatusOr<etcd::RangeResult> records =
        session_->client().GetPrefix(keys_.Durables(), {.limit = record_limit});
    session_->Note(records.status());
    if (!records.ok()) return records.status();
    if (records->more) {
      return absl::FailedPreconditionError(absl::StrCat(
          "etcd holds more than ", record_limit, " keys under ", keys_.Durables(),
          " for a job of ", layout_.node_count, " nodes"));
    }
    return records;
  }

  // How long a record waits for this daemon to be registered (at start, after a lost lease).
  static constexpr absl::Duration kRegistrationWait = absl::Seconds(2);
  static constexpr int64_t kExtraRecordKeys = 64;
  // Decisions are dropped every forget_every commits; this is far beyond what a job keeps.
  static constexpr int64_t kMaxDecisionKeys = 1 << 16;

  EtcdSession* const session_;
  const EtcdKeys keys_;
  const JobLayout layout_;
  const uint32_t node_id_;
  const Membership* const membership_;
};

class EtcdLeadership final : public Leadership {
 public:
  EtcdLeadership(EtcdSession* session, const EtcdKeys& keys, uint32_t node_id)
      : session_(session), election_(session->client(), keys.Leader()), node_id_(node_id) {}

  absl::StatusOr<int64_t> Campaign(absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    absl::StatusOr<int64_t> lease = session_->WaitLease(deadline);
    if (!lease.ok()) return lease.status();
    absl::StatusOr<etcd::Leadership> led = election_.Campaign(
        CandidateName(node_id_), CandidateName(node_id_), *lease, deadline - absl::Now());
    if (!absl::IsDeadlineExceeded(led.status())) session_->Note(led.status());
    if (!led.ok()) return led.status();
    session_->CountWrite();
    absl::MutexLock lock(&mutex_);
    held_[led->token] = *led;
    return led->token;
  }

  bool Holds(int64_t token) const override {
    absl::MutexLock lock(&mutex_);
    auto it = held_.find(token);
    return it != held_.end() && session_->Holds(it->second.lease);
  }

  void Resign(int64_t token) override {
    std::optional<etcd::Leadership> leadership;
    {
      absl::MutexLock lock(&mutex_);
      auto it = held_.find(token);
      if (it == held_.end()) return;
      leadership = it->second;
      held_.erase(it);
    }
    session_->CountWrite();
    (void)election_.Resign(*leadership);
  }

 private:
  EtcdSession* const session_;
  etcd::Election election_;
  const uint32_t node_id_;
  mutable absl::Mutex mutex_;
  std::map<int64_t, etcd::Leadership> held_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace

std::unique_ptr<DecisionLog> NewEtcdDecisionLog(EtcdSession* session, const EtcdKeys& keys,
                                                uint32_t node_id) {
  return std::make_unique<EtcdDecisionLog>(session, keys, node_id);
}

std::unique_ptr<DurableRecords> NewEtcdDurableRecords(EtcdSession* session, const EtcdKeys& keys,
                                                      const ClusterOptions& options,
                                                      uint32_t node_id,
                                                      const Membership* membership) {
  return std::make_unique<EtcdDurableRecords>(session, keys, options, node_id, membership);
}

std::unique_ptr<Leadership> NewEtcdLeadership(EtcdSession* session, const EtcdKeys& keys,
                                              uint32_t node_id) {
  return std::make_unique<EtcdLeadership>(session, keys, node_id);
}

}  // namespace moesnap::daemon::cluster
