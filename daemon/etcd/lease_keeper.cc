// Lease renewal: one keep-alive round trip (Client::KeepAliveOnce) and LeaseKeeper, which renews a
// lease every third of its TTL on a thread of its own until the lease is lost or the keeper
// destroyed.
#include <algorithm>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/etcd/endpoints.h"
#include "daemon/etcd/etcd_client.h"

namespace moesnap::etcd {
namespace {

// One renewal: a LeaseKeepAlive stream carrying one request and its answer. A stream per renewal
// costs one HTTP/2 stream on the open connection, and lets each renewal have its own deadline.
absl::StatusOr<int64_t> Renew(internal::Endpoints& endpoints, int64_t lease_id,
                              absl::Time deadline) {
  etcdserverpb::LeaseKeepAliveRequest request;
  request.set_id(lease_id);
  etcdserverpb::LeaseKeepAliveResponse response;
  const absl::Status status = endpoints.Call(
      absl::StrCat("LeaseKeepAlive of lease ", lease_id), internal::Retry::kAlways, deadline,
      [&](const internal::Endpoint& endpoint, grpc::ClientContext& context) {
        auto stream = endpoint.lease->LeaseKeepAlive(&context);
        if (stream->Write(request) && stream->WritesDone() && stream->Read(&response)) {
          context
              .TryCancel();  // the answer is in; the server ends its side when it sees the cancel
          stream->Finish().IgnoreError();
          return grpc::Status::OK;
        }
        grpc::Status finished = stream->Finish();
        return finished.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                            "keep-alive stream ended without an answer")
                             : finished;
      });
  if (!status.ok()) return status;
  if (response.ttl() <= 0) {
    return absl::NotFoundError(absl::StrCat("etcd lease ", lease_id,
                                            " expired or was revoked (etcd renewed it with TTL ",
                                            response.ttl(), ")"));
  }
  return response.ttl();
}

}  // namespace

absl::StatusOr<int64_t> Client::KeepAliveOnce(int64_t lease_id) {
  return Renew(*endpoints_, lease_id, absl::Now() + options().call_timeout);
}

class LeaseKeeper::Impl {
 public:
  Impl(std::shared_ptr<internal::Endpoints> endpoints, const Lease& lease,
       std::function<void(const absl::Status&)> on_lost)
      : endpoints_(std::move(endpoints)),
        lease_(lease),
        on_lost_(std::move(on_lost)),
        thread_([this] { Run(); }) {}

  ~Impl() {
    {
      absl::MutexLock lock(&mutex_);
      stopping_ = true;
    }
    thread_.join();
  }

  int64_t lease_id() const { return lease_.id; }

  absl::Status status() const {
    absl::MutexLock lock(&mutex_);
    return status_;
  }

  bool WaitLost(absl::Duration timeout) const {
    absl::MutexLock lock(&mutex_);
    const auto lost = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) { return !status_.ok(); };
    mutex_.AwaitWithTimeout(absl::Condition(&lost), timeout);
    return !status_.ok();
  }

  int64_t renewals() const {
    absl::MutexLock lock(&mutex_);
    return renewals_;
  }

 private:
  void Run() {
    // The lease was granted before the keeper started, so its expiry is not known here: renew at
    // once, and until that renewal counts, assume the whole TTL from now.
    absl::Time expires = absl::Now() + absl::Seconds(lease_.ttl_seconds);
    absl::Time next_renewal = absl::Now();
    absl::Duration ttl = absl::Seconds(lease_.ttl_seconds);
    while (true) {
      {
        absl::MutexLock lock(&mutex_);
        mutex_.AwaitWithDeadline(absl::Condition(&stopping_), next_renewal);
        if (stopping_) return;
      }
      const absl::Time sent = absl::Now();
      // One attempt_timeout per round, so that a destroyed keeper stops that soon; a failed round
      // moves to the next endpoint and the next round follows at once, until the lease would
      // expire.
      absl::StatusOr<int64_t> granted = Renew(
          *endpoints_, lease_.id, std::min(expires, sent + endpoints_->options().attempt_timeout));
      if (granted.ok()) {
        ttl = absl::Seconds(*granted);
        expires = sent + ttl;
        next_renewal = sent + ttl / 3;
        absl::MutexLock lock(&mutex_);
        ++renewals_;
        continue;
      }
      if (absl::IsNotFound(granted.status())) {
        Lose(granted.status());
        return;
      }
      if (absl::Now() >= expires) {
        Lose(absl::UnavailableError(
            absl::StrCat("etcd lease ", lease_.id, " was not renewed within its TTL of ",
                         absl::FormatDuration(ttl),
                         "; it must be taken as lost: ", granted.status().message())));
        return;
      }
      // No endpoint renewed it this round (or one refused for another reason than the lease's
      // loss): try again at once through the next endpoint, or shortly after a definite refusal.
      const bool unanswered =
          absl::IsDeadlineExceeded(granted.status()) || absl::IsUnavailable(granted.status());
      next_renewal = unanswered ? absl::Now() : std::min(expires, absl::Now() + ttl / 10);
    }
  }

  // The callback runs before the loss is published, so whoever sees it (status, WaitLost) also
  // sees what the callback did.
  void Lose(const absl::Status& why) {
    if (on_lost_) on_lost_(why);
    absl::MutexLock lock(&mutex_);
    status_ = why;
  }

  const std::shared_ptr<internal::Endpoints> endpoints_;
  const Lease lease_;
  const std::function<void(const absl::Status&)> on_lost_;
  mutable absl::Mutex mutex_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mutex_);
  int64_t renewals_ ABSL_GUARDED_BY(mutex_) = 0;
  std::thread thread_;  // last: starts once the fields above exist
};

std::unique_ptr<LeaseKeeper> LeaseKeeper::Start(std::shared_ptr<internal::Endpoints> endpoints,
                                                const Lease& lease,
                                                std::function<void(const absl::Status&)> on_lost) {
  return std::unique_ptr<LeaseKeeper>(
      new LeaseKeeper(std::make_unique<Impl>(std::move(endpoints), lease, std::move(on_lost))));
}

LeaseKeeper::LeaseKeeper(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LeaseKeeper::~LeaseKeeper() = default;
int64_t LeaseKeeper::lease_id() const { return impl_->lease_id(); }
absl::Status LeaseKeeper::status() const { return impl_->status(); }
bool LeaseKeeper::WaitLost(absl::Duration timeout) const { return impl_->WaitLost(timeout); }
int64_t LeaseKeeper::renewals() const { return impl_->renewals(); }

}  // namespace moesnap::etcd
