// The one place where the etcd client meets gRPC: a channel and stubs per endpoint, the choice of
// endpoint, deadlines, and whether a failed request may be sent again to another endpoint. Private
// to daemon/etcd/.
#ifndef MOESNAP_DAEMON_ETCD_ENDPOINTS_H_
#define MOESNAP_DAEMON_ETCD_ENDPOINTS_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/etcd/etcd_client.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"

namespace moesnap::etcd::internal {

// What a failed attempt says about the request.
enum class Failure {
  kDefinite,        // the member answered and would answer the same elsewhere
  kNotApplied,      // refused before it could be applied: safe to send to another member
  kOutcomeUnknown,  // may or may not have been applied
};
Failure ClassifyFailure(const grpc::Status& status);

// Whether a call may be sent again after an attempt with an unknown outcome.
enum class Retry { kAlways, kOnlyIfNotApplied };

struct Endpoint {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<etcdserverpb::KV::Stub> kv;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  std::unique_ptr<etcdserverpb::Watch::Stub> watch;
  std::unique_ptr<etcdserverpb::Maintenance::Stub> maintenance;
};

// One attempt of a call against one endpoint, with a context the caller fills and sends.
using Attempt =
    absl::FunctionRef<grpc::Status(const Endpoint& endpoint, grpc::ClientContext& context)>;

class Endpoints {
 public:
  // Checks `options` and builds the channels (which connect lazily).
  static absl::StatusOr<std::shared_ptr<Endpoints>> Create(const Options& options);

  const Options& options() const { return options_; }
  size_t size() const { return endpoints_.size(); }
  const Endpoint& at(size_t index) const { return *endpoints_[index]; }

  // Runs `attempt` on endpoints from the preferred one on, until it succeeds, fails definitely,
  // fails with an unknown outcome that `retry` does not allow to repeat, or `deadline` passes.
  // `what` names the call in error messages ("Put of 'k'").
  absl::Status Call(const std::string& what, Retry retry, absl::Time deadline, Attempt attempt);

  // The endpoint to try first.
  size_t preferred() const { return preferred_.load(); }
  // Makes the endpoint after `index` the preferred one, if `index` still is.
  void MoveAwayFrom(size_t index);
  // Endpoint `index` gave a definite answer. A failover is counted when it is the preferred
  // endpoint and the last answer came from another: the client moved and found a member. The
  // endpoints it passes over while none answers (a whole outage, each polled every round) count as
  // unanswered attempts only, and a late answer from an endpoint left since counts nothing.
  void Answered(size_t index);
  // Waits until the endpoint has a connection, up to dial_timeout and `deadline`; false at once
  // while gRPC reports its channel in TRANSIENT_FAILURE (a failed connect, TLS handshake or name
  // resolution), until a reconnection succeeds.
  bool Connect(size_t index, absl::Time deadline) const;
  // Sets the attempt's deadline (attempt_timeout, and no later than `deadline`) and asks the member
  // to refuse if it has no raft leader.
  void Prepare(grpc::ClientContext& context, absl::Time deadline) const;

 private:
  Endpoints(Options options, std::vector<std::unique_ptr<Endpoint>> endpoints);

  const Options options_;
  const std::vector<std::unique_ptr<Endpoint>> endpoints_;
  std::atomic<size_t> preferred_{0};
  std::atomic<size_t> last_answered_{0};  // calls start at the first endpoint
};

// "UNAVAILABLE: etcdserver: no leader", for messages.
std::string Describe(const grpc::Status& status);

}  // namespace moesnap::etcd::internal

#endif  // MOESNAP_DAEMON_ETCD_ENDPOINTS_H_
