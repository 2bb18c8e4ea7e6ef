// Membership: registration under the lease, the config check, and watches of members and leader.
#include "daemon/cluster/membership.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "daemon/etcd/election.h"

namespace moesnap::daemon::cluster {
namespace {

// How long a watch waits for an event before it looks whether it should stop.
constexpr absl::Duration kWatchWake = absl::Milliseconds(200);
// After a failed read or watch, before trying again.
constexpr absl::Duration kRetry = absl::Milliseconds(200);

ClusterOptions OptionsOf(const v1::ClusterShape& shape) {
  ClusterOptions options;
  options.job = shape.job();
  options.node_count = shape.node_count();
  options.data_units = static_cast<int>(shape.shape().data_units());
  options.parity_units = static_cast<int>(shape.shape().parity_units());
  options.stripe_unit_bytes = shape.shape().stripe_unit_bytes();
  options.lease_ttl_ms = shape.lease_ttl_ms();
  options.commit_timeout_ms = shape.commit_timeout_ms();
  options.allow_degraded = shape.allow_degraded();
  return options;
}

std::string AddressOf(const v1::MemberRecord& record) {
  return absl::StrCat(record.host(), ":", record.control_port(), "/", record.data_port());
}

}  // namespace

v1::ClusterShape ShapeOf(const ClusterOptions& options) {
  v1::ClusterShape shape;
  shape.mutable_shape()->set_data_units(options.data_units);
  shape.mutable_shape()->set_parity_units(options.parity_units);
  shape.mutable_shape()->set_stripe_unit_bytes(options.stripe_unit_bytes);
  shape.set_commit_timeout_ms(options.commit_timeout_ms);
  shape.set_allow_degraded(options.allow_degraded);
  shape.set_job(options.job);
  shape.set_node_count(options.node_count);
  shape.set_lease_ttl_ms(options.lease_ttl_ms);
  return shape;
}

Membership::Membership(const ClusterContext& context, EtcdSession* session, const EtcdKeys& keys)
    : context_(context), session_(session), keys_(keys) {}

Membership::~Membership() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    changed_.SignalAll();
  }
  for (std::thread& thread : threads_) thread.join();
}

bool Membership::stopping() const {
  absl::MutexLock lock(&mutex_);
  return stopping_;
}

absl::Status Membership::CheckConfig() {
  absl::StatusOr<etcd::RangeResult> members = session_->client().GetPrefix(keys_.Members());
  session_->Note(members.status());
  if (!members.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot read the job's members from etcd: ",
                                               members.status().message()));
  }
  const ClusterOptions& mine = context_.options();
  for (const etcd::KeyValue& kv : members->kvs) {
    v1::MemberRecord record;
    if (!record.ParseFromString(kv.value)) continue;
    if (record.config_digest() == mine.Digest()) continue;
    std::string difference = mine.DifferenceFrom(OptionsOf(record.shape()));
    if (difference.empty()) difference = "its config digest differs";
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", context_.node_id(), " cannot join job '", mine.job, "': node ", record.node_id(),
        " (", AddressOf(record), ") has another cluster config: ", difference));
  }
  return absl::OkStatus();
}

void Membership::Start(const v1::MemberRecord& self) {
  // A first read now, so that units starting next find the peers etcd knows of (best effort: the
  // watches read again until they can).
  (void)ReadMembers();
  (void)ReadLeader();
  threads_.emplace_back([this, self] { RegisterLoop(self); });
  threads_.emplace_back([this] { WatchMembers(); });
  threads_.emplace_back([this] { WatchLeader(); });
}

bool Membership::WaitRegistered(absl::Time deadline) const {
  absl::MutexLock lock(&mutex_);
  while (!registered_ && !stopping_) {
    if (changed_.WaitWithDeadline(&mutex_, deadline)) break;
  }
  return registered_;
}

int Membership::registrations() const {
  absl::MutexLock lock(&mutex_);
  return registrations_;
}

std::optional<int64_t> Membership::incarnation() const {
  absl::MutexLock lock(&mutex_);
  return incarnation_;
}

void Membership::RegisterLoop(v1::MemberRecord self) {
  const std::string key = keys_.Member(context_.node_id());
  // The config check, if etcd could not be asked at start.
  for (absl::Status checked = CheckConfig(); !checked.ok(); checked = CheckConfig()) {
    if (absl::IsFailedPrecondition(checked)) {
      Log(LogLevel::kError, checked.message(), "; this daemon does not join the cluster");
      return;
    }
    absl::MutexLock lock(&mutex_);
    if (!stopping_) changed_.WaitWithTimeout(&mutex_, kRetry);
    if (stopping_) return;
  }
  std::string waiting_for;  // the other daemon this one last said it waits for
  while (!stopping()) {
    absl::StatusOr<int64_t> lease = session_->WaitLease(absl::Now() + kWatchWake);
    if (!lease.ok()) continue;
    session_->CountWrite();
    absl::StatusOr<etcd::KeyValue> stored =
        session_->client().WriteOnce(key, self.SerializeAsString(), std::nullopt, *lease);
    session_->Note(stored.status());
    if (!stored.ok()) {
      absl::MutexLock lock(&mutex_);
      changed_.WaitWithTimeout(&mutex_, kRetry);
      continue;
    }
    if (stored->lease == *lease) {
      {
        absl::MutexLock lock(&mutex_);
        registered_ = true;
        incarnation_ = stored->create_revision;
        ++registrations_;
        changed_.SignalAll();
      }
      Log(LogLevel::kInfo, "node ", context_.node_id(), " registered in job '",
          context_.options().job, "' as ", AddressOf(self), " (incarnation ",
          stored->create_revision, ")");
      waiting_for.clear();
      while (session_->Holds(*lease) && !stopping()) {
        session_->WaitLeaseChange(*lease, absl::Now() + kWatchWake);
      }
      absl::MutexLock lock(&mutex_);
      registered_ = false;
      incarnation_.reset();
      changed_.SignalAll();
      continue;
    }
    // Another daemon holds this node id: a predecessor whose lease has not expired yet (or a
    // duplicate started by mistake). Its key goes when its lease does.
    v1::MemberRecord holder;
    holder.ParseFromString(stored->value);
    const std::string description =
        absl::StrCat(AddressOf(holder), " on ", holder.hostname(), ", incarnation ",
                     stored->create_revision);
    if (description != waiting_for) {
      Log(LogLevel::kWarning, "node id ", context_.node_id(), " is held by ", description,
          "; waiting for its lease to expire");
      waiting_for = description;
    }
    absl::StatusOr<std::unique_ptr<etcd::Watcher>> watcher =
        session_->client().WatchKey(key, stored->mod_revision + 1);
    if (!watcher.ok()) continue;
    while (!stopping() && session_->Holds(*lease)) {
      absl::StatusOr<etcd::WatchEvent> event = (*watcher)->Next(kWatchWake);
      if (event.ok() && event->type == etcd::WatchEvent::Type::kDelete) break;
      if (!event.ok() && !absl::IsDeadlineExceeded(event.status())) break;
    }
  }
}

absl::StatusOr<int64_t> Membership::ReadMembers() {
  absl::StatusOr<etcd::RangeResult> members = session_->client().GetPrefix(keys_.Members());
  session_->Note(members.status());
  if (!members.ok()) return members.status();
  std::set<uint32_t> present;
  for (const etcd::KeyValue& kv : members->kvs) {
    v1::MemberRecord record;
    const std::optional<uint32_t> id = keys_.MemberOf(kv.key);
    if (!id || !record.ParseFromString(kv.value) || record.node_id() != *id) continue;
    present.insert(*id);
    context_.nodes->Set({.id = *id,
                         .address = {*id, record.host(),
                                     static_cast<uint16_t>(record.control_port()),
                                     static_cast<uint16_t>(record.data_port())},
                         .hostname = record.hostname(),
                         .incarnation = kv.create_revision});
  }
  for (uint32_t id : context_.nodes->Ids()) {
    if (!present.contains(id)) context_.nodes->Remove(id);
  }
  return members->revision;
}

void Membership::WatchMembers() {
  while (!stopping()) {
    absl::StatusOr<int64_t> revision = ReadMembers();
    if (!revision.ok()) {
      absl::MutexLock lock(&mutex_);
      changed_.WaitWithTimeout(&mutex_, kRetry);
      continue;
    }
    absl::StatusOr<std::unique_ptr<etcd::Watcher>> watcher =
        session_->client().WatchPrefix(keys_.Members(), *revision + 1);
    if (!watcher.ok()) continue;
    while (!stopping()) {
      absl::StatusOr<etcd::WatchEvent> event = (*watcher)->Next(kWatchWake);
      if (absl::IsDeadlineExceeded(event.status())) continue;
      if (!event.ok()) break;  // compacted past, or failed for good: read everything again
      const std::optional<uint32_t> id = keys_.MemberOf(event->kv.key);
      if (!id) continue;
      if (event->type == etcd::WatchEvent::Type::kDelete) {
        Log(LogLevel::kWarning, "node ", *id, " is lost: its daemon's lease ended");
        context_.nodes->Remove(*id);
        continue;
      }
      v1::MemberRecord record;
      if (!record.ParseFromString(event->kv.value) || record.node_id() != *id) continue;
      Log(LogLevel::kInfo, "node ", *id, " is live at ", AddressOf(record), " on ",
          record.hostname(), " (incarnation ", event->kv.create_revision, ")");
      context_.nodes->Set({.id = *id,
                           .address = {*id, record.host(),
                                       static_cast<uint16_t>(record.control_port()),
                                       static_cast<uint16_t>(record.data_port())},
                           .hostname = record.hostname(),
                           .incarnation = event->kv.create_revision});
    }
  }
}

absl::StatusOr<int64_t> Membership::ReadLeader() {
  etcd::Election election(session_->client(), keys_.Leader());
  absl::StatusOr<etcd::RangeResult> probe =
      session_->client().GetPrefix(keys_.Leader() + "/", {.limit = 1});
  if (!probe.ok()) return probe.status();
  absl::StatusOr<std::optional<etcd::Leader>> leader = election.CurrentLeader();
  session_->Note(leader.status());
  if (!leader.ok()) return leader.status();
  std::optional<LeaderView> view;
  if (leader->has_value()) {
    if (std::optional<uint32_t> id = EtcdKeys::NodeOfCandidate((*leader)->name)) {
      view = LeaderView{*id, (*leader)->token()};
    }
  }
  const std::optional<LeaderView> before = context_.nodes->Leader();
  if (view && (!before || before->token != view->token)) {
    Log(LogLevel::kInfo, "node ", view->node_id, " coordinates (fencing token ", view->token, ")");
  }
  context_.nodes->SetLeader(view);
  return probe->revision;
}

void Membership::WatchLeader() {
  while (!stopping()) {
    absl::StatusOr<int64_t> revision = ReadLeader();
    if (!revision.ok()) {
      absl::MutexLock lock(&mutex_);
      changed_.WaitWithTimeout(&mutex_, kRetry);
      continue;
    }
    absl::StatusOr<std::unique_ptr<etcd::Watcher>> watcher =
        session_->client().WatchPrefix(keys_.Leader() + "/", *revision + 1);
    if (!watcher.ok()) continue;
    while (!stopping()) {
      absl::StatusOr<etcd::WatchEvent> event = (*watcher)->Next(kWatchWake);
      if (absl::IsDeadlineExceeded(event.status())) continue;
      if (!event.ok()) break;
      // Any candidate coming or going may change who leads: read it again.
      if (!ReadLeader().ok()) break;
    }
  }
}

}  // namespace moesnap::daemon::cluster
