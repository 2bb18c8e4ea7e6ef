// EtcdSession: a lease granted, kept, and granted again; reachability from renewals and calls.
#include "daemon/cluster/etcd_session.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace moesnap::daemon::cluster {
namespace {

// How often the session looks at its keeper between renewals.
constexpr absl::Duration kCheckInterval = absl::Milliseconds(200);

bool SaysUnreachable(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdSession>> EtcdSession::Start(const ClusterOptions& options,
                                                                uint32_t node_id) {
  etcd::Options etcd_options;
  etcd_options.endpoints = options.etcd_endpoints;
  etcd_options.tls = options.EtcdTls(node_id);
  // A call must end well within a lease, so that a node never waits on etcd past its own loss.
  const absl::Duration ttl = absl::Milliseconds(options.lease_ttl_ms);
  etcd_options.call_timeout = std::min(etcd_options.call_timeout, ttl / 2);
  etcd_options.attempt_timeout = std::min(etcd_options.attempt_timeout, ttl / 4);
  absl::StatusOr<std::unique_ptr<etcd::Client>> client = etcd::Client::Create(etcd_options);
  if (!client.ok()) return client.status();
  std::unique_ptr<EtcdSession> session(new EtcdSession(*std::move(client), ttl));
  session->thread_ = std::thread([raw = session.get()] { raw->KeepLeases(); });
  return session;
}

EtcdSession::EtcdSession(std::unique_ptr<etcd::Client> client, absl::Duration ttl)
    : client_(std::move(client)), ttl_(ttl) {}

EtcdSession::~EtcdSession() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    changed_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mutex_);
    keeper_.reset();
    lease = lease_;
  }
  // Peers see this node go now, not a TTL later (a restart or replacement need not wait).
  if (lease != 0) (void)client_->RevokeLease(lease);
}

bool EtcdSession::Sleep(absl::Duration duration) {
  const absl::Time until = absl::Now() + duration;
  absl::MutexLock lock(&mutex_);
  while (!stopping_ && !changed_.WaitWithDeadline(&mutex_, until)) {
  }
  return !stopping_;
}

void EtcdSession::KeepLeases() {
  absl::Duration backoff = absl::Milliseconds(100);
  while (true) {
    {
      absl::MutexLock lock(&mutex_);
      if (stopping_) return;
    }
    absl::StatusOr<etcd::Lease> lease = client_->GrantLease(ttl_);
    absl::StatusOr<std::unique_ptr<etcd::LeaseKeeper>> keeper =
        lease.ok() ? client_->KeepAlive(*lease) : lease.status();
    Note(keeper.status());
    if (!keeper.ok()) {
      Log(LogLevel::kDebug, "etcd: no lease yet: ", keeper.status().message());
      if (!Sleep(backoff)) return;
      backoff = std::min(backoff * 2, ttl_ / 4);
      continue;
    }
    backoff = absl::Milliseconds(100);
    etcd::LeaseKeeper* current = keeper->get();
    {
      absl::MutexLock lock(&mutex_);
      keeper_ = *std::move(keeper);
      lease_ = lease->id;
      changed_.SignalAll();
    }
    Log(LogLevel::kInfo, "etcd: holding lease ", lease->id, " (TTL ",
        absl::FormatDuration(ttl_), ")");
    // A renewal goes every third of the TTL; one overdue by more than an attempt says etcd cannot
    // be reached from here.
    int64_t renewals = current->renewals();
    absl::Time renewed = absl::Now();
    const absl::Duration overdue = ttl_ / 3 + client_->options().attempt_timeout;
    while (!current->WaitLost(kCheckInterval)) {
      {
        absl::MutexLock lock(&mutex_);
        if (stopping_) return;
      }
      if (const int64_t now_renewals = current->renewals(); now_renewals != renewals) {
        renewals = now_renewals;
        renewed = absl::Now();
        Note(absl::OkStatus());
      } else if (absl::Now() - renewed > overdue) {
        absl::MutexLock lock(&mutex_);
        if (!unreachable_since_) unreachable_since_ = renewed + ttl_ / 3;
      }
    }
    Log(LogLevel::kWarning, "etcd: lease ", lease->id, " lost (", current->status().message(),
        "): this node's keys are gone until a new lease holds them");
    absl::MutexLock lock(&mutex_);
    keep_alives_ += current->renewals();
    keeper_.reset();
    lease_ = 0;
    changed_.SignalAll();
  }
}

absl::StatusOr<int64_t> EtcdSession::WaitLease(absl::Time deadline) {
  absl::MutexLock lock(&mutex_);
  while (lease_ == 0 && !stopping_) {
    if (changed_.WaitWithDeadline(&mutex_, deadline)) break;
  }
  if (lease_ != 0) return lease_;
  return absl::UnavailableError(absl::StrCat(
      "no etcd lease: etcd (", absl::StrJoin(client_->options().endpoints, ", "),
      ") cannot be reached", unreachable_since_
                                 ? absl::StrCat(" since ", absl::FormatTime(*unreachable_since_))
                                 : ""));
}

bool EtcdSession::Holds(int64_t lease) const {
  absl::MutexLock lock(&mutex_);
  return lease != 0 && lease == lease_;
}

void EtcdSession::WaitLeaseChange(int64_t lease, absl::Time deadline) const {
  absl::MutexLock lock(&mutex_);
  while (lease_ == lease && !stopping_) {
    if (changed_.WaitWithDeadline(&mutex_, deadline)) return;
  }
}

void EtcdSession::Note(const absl::Status& status) {
  absl::MutexLock lock(&mutex_);
  if (status.ok()) {
    if (unreachable_since_) {
      Log(LogLevel::kInfo, "etcd: reachable again after ",
          absl::FormatDuration(absl::Now() - *unreachable_since_));
    }
    unreachable_since_.reset();
  } else if (SaysUnreachable(status) && !unreachable_since_) {
    unreachable_since_ = absl::Now();
    Log(LogLevel::kWarning, "etcd: cannot be reached (", status.message(),
        "); captures go on, commits pause until it can");
  }
}

std::optional<absl::Time> EtcdSession::unreachable_since() const {
  absl::MutexLock lock(&mutex_);
  return unreachable_since_;
}

uint64_t EtcdSession::keep_alives() const {
  absl::MutexLock lock(&mutex_);
  return keep_alives_ + (keeper_ ? keeper_->renewals() : 0);
}

}  // namespace moesnap::daemon::cluster
