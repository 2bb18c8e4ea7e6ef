// Membership: the config check at join, heartbeat loops, and the coordinator choice.
#include "daemon/cluster/membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "daemon/cluster/parallel.h"

namespace moesnap::daemon::cluster {
namespace {

v1::ClusterShape ShapeOf(const ClusterOptions& options) {
  v1::ClusterShape shape;
  shape.mutable_shape()->set_data_units(options.data_units);
  shape.mutable_shape()->set_parity_units(options.parity_units);
  shape.mutable_shape()->set_stripe_unit_bytes(options.stripe_unit_bytes);
  shape.set_heartbeat_timeout_ms(options.heartbeat_timeout_ms);
  shape.set_commit_timeout_ms(options.commit_timeout_ms);
  shape.set_allow_degraded(options.allow_degraded);
  for (const ClusterNode& node : options.nodes) {
    v1::PeerAddress* address = shape.add_nodes();
    address->set_id(node.id);
    address->set_host(node.host);
    address->set_control_port(node.control_port);
    address->set_data_port(node.data_port);
  }
  return shape;
}

ClusterOptions OptionsOf(const v1::ClusterShape& shape) {
  ClusterOptions options;
  options.data_units = static_cast<int>(shape.shape().data_units());
  options.parity_units = static_cast<int>(shape.shape().parity_units());
  options.stripe_unit_bytes = shape.shape().stripe_unit_bytes();
  options.heartbeat_timeout_ms = shape.heartbeat_timeout_ms();
  options.commit_timeout_ms = shape.commit_timeout_ms();
  options.allow_degraded = shape.allow_degraded();
  for (const v1::PeerAddress& address : shape.nodes()) {
    options.nodes.push_back({address.id(), address.host(),
                             static_cast<uint16_t>(address.control_port()),
                             static_cast<uint16_t>(address.data_port())});
  }
  return options;
}

}  // namespace

absl::Duration HeartbeatInterval(const ClusterOptions& options) {
  return std::max(absl::Milliseconds(options.heartbeat_timeout_ms) / 5, absl::Milliseconds(20));
}

Membership::Membership(const ClusterContext& context)
    : context_(context),
      interval_(HeartbeatInterval(context.options())),
      digest_(context.options().Digest()) {}

Membership::~Membership() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    stopping_changed_.SignalAll();
  }
  for (std::thread& thread : threads_) thread.join();
}

absl::Status Membership::Join() {
  v1::HeartbeatRequest hello;
  hello.set_from_node(context_.node_id());
  hello.set_cluster_digest(digest_);
  *hello.mutable_cluster() = ShapeOf(context_.options());
  std::vector<uint32_t> peers;
  for (uint32_t id : context_.nodes->Ids()) {
    if (id != context_.node_id()) peers.push_back(id);
  }
  std::vector<absl::Status> answers = InParallel(peers, [&](uint32_t id) -> absl::Status {
    absl::StatusOr<v1::HeartbeatResponse> response = context_.peers->Heartbeat(id, hello);
    if (response.ok()) context_.nodes->Heard(id, *response);
    return response.status();
  });
  for (size_t i = 0; i < peers.size(); ++i) {
    if (absl::IsFailedPrecondition(answers[i])) {
      return absl::FailedPreconditionError(
          absl::StrCat("node ", peers[i], " refuses to join: ", answers[i].message()));
    }
  }
  return absl::OkStatus();
}

void Membership::Start() {
  for (uint32_t id : context_.nodes->Ids()) {
    if (id != context_.node_id()) threads_.emplace_back([this, id] { HeartbeatLoop(id); });
  }
}

bool Membership::SleepUnlessStopping(absl::Duration duration) {
  const absl::Time until = absl::Now() + duration;
  absl::MutexLock lock(&mutex_);
  while (!stopping_ && !stopping_changed_.WaitWithDeadline(&mutex_, until)) {
  }
  return !stopping_;
}

void Membership::HeartbeatLoop(uint32_t peer) {
  v1::HeartbeatRequest request;
  request.set_from_node(context_.node_id());
  request.set_cluster_digest(digest_);
  do {
    absl::StatusOr<v1::HeartbeatResponse> response = context_.peers->Heartbeat(peer, request);
    const bool changed =
        response.ok() ? context_.nodes->Heard(peer, *response)
                      : context_.nodes->Missed(
                            peer, absl::IsFailedPrecondition(response.status())
                                      ? std::optional<std::string>(response.status().message())
                                      : std::nullopt);
    if (changed) {
      const bool live = context_.nodes->Live(peer);
      Log(live ? LogLevel::kInfo : LogLevel::kWarning, "node ", peer,
          live ? " is live" : " is lost: no heartbeat answered for ",
          live ? "" : absl::StrCat(context_.options().heartbeat_timeout_ms, " ms"));
    }
  } while (SleepUnlessStopping(interval_));
}

absl::Status Membership::CheckPeer(const v1::HeartbeatRequest& request) const {
  const uint32_t self = context_.node_id();
  if (request.has_cluster()) {
    const std::string difference = context_.options().DifferenceFrom(OptionsOf(request.cluster()));
    if (!difference.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("node ", request.from_node(),
                                                        " has another cluster config than node ",
                                                        self, ": ", difference));
    }
  } else if (request.cluster_digest() != digest_) {
    return absl::FailedPreconditionError(
        absl::StrCat("node ", request.from_node(), " has another cluster config than node ", self,
                     " (its digest differs; restarting it names the difference)"));
  }
  return absl::OkStatus();
}

uint32_t Membership::Coordinator() const {
  const std::vector<uint32_t> live = context_.nodes->LiveIds();
  return live.empty() ? context_.node_id() : live.front();
}

absl::Status Membership::CheckCoordinator(uint32_t coordinator) const {
  for (uint32_t id : context_.nodes->LiveIds()) {
    if (id >= coordinator) break;
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", coordinator, " is not the coordinator: node ", id, " is live and lower"));
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon::cluster
