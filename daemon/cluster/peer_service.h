// The Peer gRPC service: each handler authenticates its caller (peer_authenticator.h), checks its
// request (peer_checks.h), calls the unit that owns the call, and converts the result at the edge.
// No other logic lives here.
#ifndef MOESNAP_DAEMON_CLUSTER_PEER_SERVICE_H_
#define MOESNAP_DAEMON_CLUSTER_PEER_SERVICE_H_

#include "daemon/caller_gate.h"
#include "daemon/cluster/coordinator.h"
#include "daemon/cluster/durable_view.h"
#include "daemon/cluster/local_report.h"
#include "daemon/cluster/log_forwarding.h"
#include "daemon/cluster/peer_authenticator.h"
#include "daemon/cluster/participant.h"
#include "daemon/cluster/peer_checks.h"
#include "daemon/cluster/rebuild.h"
#include "daemon/cluster/remote_restore.h"
#include "daemon/cluster/transfer.h"
#include "proto/moesnap.grpc.pb.h"

namespace moesnap::daemon::cluster {

struct PeerServiceUnits {
  Coordinator* coordinator = nullptr;
  Participant* participant = nullptr;
  Transfer* transfer = nullptr;
  Rebuilder* rebuilder = nullptr;
  RemoteRestore* remote_restore = nullptr;
  LogForwarding* log_forwarding = nullptr;
  const LocalReport* report = nullptr;
  const DurableView* durable = nullptr;
  const PeerLimits* limits = nullptr;
  const PeerAuthenticator* authenticator = nullptr;
};

class PeerService final : public v1::Peer::Service {
 public:
  explicit PeerService(const PeerServiceUnits& units);

  grpc::Status Describe(grpc::ServerContext*, const v1::DescribeRequest*,
                        v1::NodeReport*) override;
  grpc::Status Propose(grpc::ServerContext*, const v1::ProposeRequest*,
                       v1::ProposeResponse*) override;
  grpc::Status Prepare(grpc::ServerContext*, const v1::PrepareRequest*,
                       v1::PrepareResponse*) override;
  grpc::Status Encode(grpc::ServerContext*, const v1::EncodeRequest*,
                      v1::EncodeResponse*) override;
  grpc::Status GroupState(grpc::ServerContext*, const v1::GroupStateRequest*,
                          v1::GroupStateResponse*) override;
  grpc::Status SendUnits(grpc::ServerContext*, const v1::SendUnitsRequest*,
                         v1::SendUnitsResponse*) override;
  grpc::Status DecodeUnits(grpc::ServerContext*, const v1::DecodeUnitsRequest*,
                           v1::DecodeUnitsResponse*) override;
  grpc::Status Rebuild(grpc::ServerContext*, const v1::PeerRebuildRequest*,
                       v1::RebuildResponse*) override;
  grpc::Status LocateRank(grpc::ServerContext*, const v1::LocateRankRequest*,
                          v1::LocateRankResponse*) override;
  grpc::Status FetchLog(grpc::ServerContext*, const v1::FetchLogRequest*,
                        v1::FetchLogResponse*) override;
  grpc::Status DurableState(grpc::ServerContext*, const v1::DurableStateRequest*,
                            v1::DurableStateResponse*) override;

 private:
  // An admitted call: its caller (nullopt without TLS) and the caller's slot it holds until it
  // ends.
  struct Admission {
    std::optional<uint32_t> caller;
    CallerGate::Pass pass;
  };
  // Calls one caller may have in flight at once (caller_gate.h): well above what a live peer
  // needs (a coordinator's Prepare and Encode of a few steps, a survey, a rebuild's fetches).
  static constexpr int kCallsPerCaller = 16;

  // The caller, authenticated and within its bound of calls in flight; when the request acts as a
  // node (`field` names it), it must be the caller. Refusals are the status to answer.
  absl::StatusOr<Admission> Admit(const grpc::ServerContext& context);
  absl::StatusOr<Admission> Admit(const grpc::ServerContext& context, uint32_t acts_as,
                                  absl::string_view field);

  const PeerServiceUnits units_;
  CallerGate gate_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_PEER_SERVICE_H_
