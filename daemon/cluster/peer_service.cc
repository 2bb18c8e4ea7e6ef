// PeerService: request in, the owning unit's answer out.
#include "daemon/cluster/peer_service.h"

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/metrics.h"

namespace moesnap::daemon::cluster {
namespace {

// Registered when the program starts, so a scrape sees it before the first refusal.
metrics::Counter& peer_calls_refused = metrics::Registry::Default().AddCounter(
    "moesnap_peer_calls_refused_total",
    "Peer calls refused because their caller had as many calls in flight as one caller may have");

// Copies an answer into the response, or converts its failure.
template <typename Response>
grpc::Status Answer(absl::StatusOr<Response> answer, Response* response) {
  if (!answer.ok()) return ToGrpcStatus(answer.status());
  *response = *std::move(answer);
  return grpc::Status::OK;
}

}  // namespace

PeerService::PeerService(const PeerServiceUnits& units)
    : units_(units), gate_(kCallsPerCaller, &peer_calls_refused) {}

absl::StatusOr<PeerService::Admission> PeerService::Admit(
    const grpc::ServerContext& context) {
  absl::StatusOr<std::optional<uint32_t>> caller =
      units_.authenticator->Caller(*context.auth_context());
  if (!caller.ok()) return caller.status();
  // Without TLS a caller is known by its connection only.
  absl::StatusOr<CallerGate::Pass> pass =
      gate_.Enter(*caller ? absl::StrCat("node ", **caller) : absl::StrCat("peer ", context.peer()));
  if (!pass.ok()) return pass.status();
  return Admission{*caller, *std::move(pass)};
}

absl::StatusOr<PeerService::Admission> PeerService::Admit(const grpc::ServerContext& context,
                                                          uint32_t acts_as,
                                                          absl::string_view field) {
  absl::StatusOr<Admission> admitted = Admit(context);
  if (!admitted.ok()) return admitted.status();
  if (absl::Status acts = units_.authenticator->ActsAs(admitted->caller, acts_as, field);
      !acts.ok()) {
    return acts;
  }
  return admitted;
}

grpc::Status PeerService::Describe(grpc::ServerContext* context, const v1::DescribeRequest*,
                                   v1::NodeReport* response) {
  const absl::StatusOr<Admission> admitted = Admit(*context);
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  *response = units_.report->Describe();
  return grpc::Status::OK;
}

grpc::Status PeerService::Propose(grpc::ServerContext* context, const v1::ProposeRequest* request,
                                  v1::ProposeResponse* response) {
  const absl::StatusOr<Admission> admitted = Admit(*context, request->from_node(), "from_node");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (absl::Status checked = CheckPropose(*request, *units_.limits); !checked.ok()) {
    return ToGrpcStatus(checked);
  }
  return Answer(units_.coordinator->Propose(*request), response);
}

grpc::Status PeerService::Prepare(grpc::ServerContext* context, const v1::PrepareRequest* request,
                                  v1::PrepareResponse* response) {
  const absl::StatusOr<Admission> admitted = Admit(*context, request->coordinator(), "coordinator");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (absl::Status checked = CheckPrepare(*request, *units_.limits); !checked.ok()) {
    return ToGrpcStatus(checked);
  }
  return Answer(units_.participant->Prepare(*request), response);
}

grpc::Status PeerService::Encode(grpc::ServerContext* context, const v1::EncodeRequest* request,
                                 v1::EncodeResponse* response) {
  const absl::StatusOr<Admission> admitted = Admit(*context, request->coordinator(), "coordinator");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (absl::Status checked = CheckEncode(*request, *units_.limits); !checked.ok()) {
    return ToGrpcStatus(checked);
  }
  return Answer(units_.participant->Encode(*request), response);
}

grpc::Status PeerService::GroupState(grpc::ServerContext* context, const v1::GroupStateRequest*,
                                     v1::GroupStateResponse* response) {
  const absl::StatusOr<Admission> admitted = Admit(*context);
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  *response = units_.rebuilder->GroupState();
  return grpc::Status::OK;
}

grpc::Status PeerService::SendUnits(grpc::ServerContext* context, const v1::SendUnitsRequest* request,
                                    v1::SendUnitsResponse* response) {
  const absl::StatusOr<Admission> admitted = Admit(*context, request->to_node(), "to_node");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (absl::Status checked = CheckSendUnits(*request, *units_.limits); !checked.ok()) {
    return ToGrpcStatus(checked);
  }
  return Answer(units_.transfer->ServeUnits(*request), response);
}

grpc::Status PeerService::DecodeUnits(grpc::ServerContext* context,
                                      const v1::DecodeUnitsRequest* request,
                                      v1::DecodeUnitsResponse* response) {
  const absl::StatusOr<Admission> admitted = Admit(*context, request->to_node(), "to_node");
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (absl::Status checked = CheckDecodeUnits(*request, *units_.limits); !checked.ok()) {
    return ToGrpcStatus(checked);
  }
  return Answer(
      units_.rebuilder->DecodeFor(*request, [context] { return context->IsCancelled(); }),
      response);
}

grpc::Status PeerService::Rebuild(grpc::ServerContext* context, const v1::PeerRebuildRequest*,
                                  v1::RebuildResponse* response) {
  const absl::StatusOr<Admission> admitted = Admit(*context);
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  return Answer(units_.rebuilder->RebuildHere(), response);
}

grpc::Status PeerService::LocateRank(grpc::ServerContext* context, const v1::LocateRankRequest* request,
                                     v1::LocateRankResponse* response) {
  const absl::StatusOr<Admission> admitted = Admit(*context);
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  *response = units_.remote_restore->Locate(*request);
  return grpc::Status::OK;
}

grpc::Status PeerService::FetchLog(grpc::ServerContext* context, const v1::FetchLogRequest* request,
                                   v1::FetchLogResponse* response) {
  const absl::StatusOr<Admission> admitted = Admit(*context);
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  return Answer(units_.log_forwarding->FetchLocal(*request), response);
}

grpc::Status PeerService::DurableState(grpc::ServerContext* context, const v1::DurableStateRequest*,
                                       v1::DurableStateResponse* response) {
  const absl::StatusOr<Admission> admitted = Admit(*context);
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  return Answer(units_.durable->Local(), response);
}

}  // namespace moesnap::daemon::cluster
