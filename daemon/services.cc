// AgentService and AdminService: request/response conversion around Store.
#include "daemon/services.h"

#include <unistd.h>

#include <optional>
#include <vector>

#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/memory_handoff_wire.h"
#include "common/metrics.h"
#include "daemon/cluster/group_shards.h"
#include "daemon/group_pieces.h"
#include "daemon/progress.h"
#include "daemon/request_checks.h"

namespace moesnap::daemon {
namespace {

// Registered when the program starts, so a scrape sees them before the first snapshot.
metrics::Histogram& snapshot_blocking_seconds = metrics::Registry::Default().AddHistogram(
    "moesnap_snapshot_blocking_seconds",
    "Time a trainer's Snapshot call spends in the daemon (the trainer waits for it; the copy runs "
    "after it returns)",
    metrics::DurationBuckets());
metrics::Counter& snapshot_bytes = metrics::Registry::Default().AddCounter(
    "moesnap_snapshot_bytes_total", "Bytes trainers' Snapshot calls asked the daemon to capture");
metrics::Counter& trainer_calls_refused = metrics::Registry::Default().AddCounter(
    "moesnap_trainer_calls_refused_total",
    "Trainer calls refused because their rank had as many calls in flight as one rank may have");

// The default thread cap leaves every rank of a node sized for its whole bound.
static_assert(kDefaultAgentMaxThreads >= kAgentRanksSized * AgentService::kCallsPerRank);

// Waits without a client deadline are bounded so a forgotten call cannot pin a thread forever.
constexpr absl::Duration kLongestWait = absl::Hours(1);

absl::Time DeadlineOf(const grpc::ServerContext* context) {
  const absl::Time client = absl::FromChrono(context->deadline());
  return std::min(client, absl::Now() + kLongestWait);
}

std::vector<std::string> Names(const google::protobuf::RepeatedPtrField<std::string>& names) {
  return std::vector<std::string>(names.begin(), names.end());
}

}  // namespace

AgentService::AgentService(Store* store, TrainerSessions* sessions, UpstreamLog* log,
                           Cluster* cluster, durable::RestoreTiers* tiers,
                           const ConnectionPeers* peers, NodeFacts facts)
    : store_(store), sessions_(sessions), log_(log), cluster_(cluster), tiers_(tiers),
      peers_(peers), facts_(std::move(facts)), gate_(kCallsPerRank, &trainer_calls_refused) {}

absl::Status AgentService::WaitRestorable(absl::Time deadline) const {
  return cluster_ != nullptr ? cluster_->WaitRestorable(deadline) : absl::OkStatus();
}

absl::Status AgentService::CheckRank(const grpc::ServerContext& context, uint32_t rank) const {
  const auto& metadata = context.client_metadata();
  auto presented = metadata.find(memory_handoff::kSessionMetadataKey);
  if (presented == metadata.end()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "a call for rank ", rank, " without a session: a trainer calls Hello first and presents "
        "the session it returned (metadata ", memory_handoff::kSessionMetadataKey,
        ") on every later call"));
  }
  absl::StatusOr<uint32_t> bound =
      sessions_->RankOf(std::string(presented->second.data(), presented->second.size()));
  if (!bound.ok()) {
    return absl::PermissionDeniedError(absl::StrCat("a call for rank ", rank, ": ",
                                                    bound.status().message()));
  }
  if (*bound != rank) {
    return absl::PermissionDeniedError(absl::StrCat(
        "a call for rank ", rank, " from the session of rank ", *bound,
        " (bound at its Hello): a trainer acts for its own rank only"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CallerGate::Pass> AgentService::Admit(const grpc::ServerContext& context,
                                                     uint32_t rank) {
  if (absl::Status bound = CheckRank(context, rank); !bound.ok()) return bound;
  return gate_.Enter(absl::StrCat("rank ", rank));
}

grpc::Status AgentService::Hello(grpc::ServerContext* context, const v1::HelloRequest* request,
                                 v1::HelloResponse* response) {
  absl::StatusOr<ucred> caller = peers_->Of(*context);
  if (!caller.ok()) return ToGrpcStatus(absl::PermissionDeniedError(caller.status().message()));
  absl::StatusOr<TrainerSessions::Session> session =
      sessions_->Start(request->rank(), {.uid = caller->uid, .pid = caller->pid});
  if (!session.ok()) return ToGrpcStatus(session.status());
  for (const auto& [rank, number] : session->abandoned) store_->EndSession(rank, number);
  if (absl::Status started = store_->StartSession(request->rank(), session->number);
      !started.ok()) {
    sessions_->End(session->token);  // the store refused the rank: no session of it either
    return ToGrpcStatus(started);
  }
  response->set_session(session->token);
  response->set_memory_socket(facts_.memory_socket);
  response->set_keeps_exited_memory(sessions_->keeps_exited_memory());
  response->set_node_id(facts_.node_id);
  response->set_pool_bytes(store_->Status().pool_bytes());
  response->set_supports_device_memory(facts_.supports_device_memory);
  // Only once this node holds what was committed (a replacement may still be rebuilding it).
  std::optional<int64_t> latest = store_->LatestCommitted(request->rank());
  if (latest && WaitRestorable(absl::Now()).ok()) {
    response->set_latest_committed_step(*latest);
  }
  return grpc::Status::OK;
}

grpc::Status AgentService::RegisterRegions(grpc::ServerContext* context,
                                           const v1::RegisterRegionsRequest* request,
                                           v1::RegisterRegionsResponse*) {
  const absl::StatusOr<CallerGate::Pass> admitted = Admit(*context, request->rank());
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (absl::Status valid = CheckRegisterRegions(*request); !valid.ok()) return ToGrpcStatus(valid);
  std::vector<v1::RegionSpec> regions(request->regions().begin(), request->regions().end());
  return ToGrpcStatus(store_->RegisterRegions(request->rank(), regions));
}

grpc::Status AgentService::Snapshot(grpc::ServerContext* context, const v1::SnapshotRequest* request,
                                    v1::SnapshotResponse* response) {
  const absl::StatusOr<CallerGate::Pass> admitted = Admit(*context, request->rank());
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (absl::Status valid = CheckSnapshot(*request); !valid.ok()) return ToGrpcStatus(valid);
  // The rank's process registered what it takes over before snapshotting: the rest may go.
  sessions_->ExpireKept(request->rank());
  const absl::Time started = absl::Now();
  std::optional<v1::SparseSlot> sparse;
  if (request->has_sparse()) sparse = request->sparse();
  std::optional<AbandonMark> abandon_mark;
  if (request->has_abandon_mark()) {
    absl::StatusOr<std::shared_ptr<TrainerMemory>> memory =
        sessions_->Find(request->rank(), request->abandon_mark().memory());
    if (!memory.ok()) return ToGrpcStatus(memory.status());
    absl::StatusOr<AbandonMark> mark = AbandonMark::In(*std::move(memory), request->abandon_mark());
    if (!mark.ok()) return ToGrpcStatus(mark.status());
    abandon_mark = *std::move(mark);
  }
  absl::StatusOr<v1::SnapshotResponse> taken = store_->Snapshot(
      request->rank(), request->step(), Names(request->regions()), sparse,
      std::move(abandon_mark));
  snapshot_blocking_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - started));
  if (!taken.ok()) return ToGrpcStatus(taken.status());
  snapshot_bytes.Add(taken->bytes());
  *response = *std::move(taken);
  return grpc::Status::OK;
}

grpc::Status AgentService::WaitCaptured(grpc::ServerContext* context, const v1::WaitRequest* request,
                                        v1::WaitResponse* response) {
  const absl::StatusOr<CallerGate::Pass> admitted = Admit(*context, request->rank());
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (absl::Status valid = CheckWait(*request); !valid.ok()) return ToGrpcStatus(valid);
  absl::StatusOr<v1::StepState> state = store_->WaitCaptured(
      request->rank(), request->step(), DeadlineOf(context), [context] { return context->IsCancelled(); });
  if (!state.ok()) return ToGrpcStatus(state.status());
  response->set_state(*state);
  return grpc::Status::OK;
}

grpc::Status AgentService::WaitCommitted(grpc::ServerContext* context,
                                         const v1::WaitRequest* request,
                                         v1::WaitResponse* response) {
  const absl::StatusOr<CallerGate::Pass> admitted = Admit(*context, request->rank());
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (absl::Status valid = CheckWait(*request); !valid.ok()) return ToGrpcStatus(valid);
  absl::StatusOr<v1::StepState> state = store_->WaitCommitted(
      request->rank(), request->step(), DeadlineOf(context), [context] { return context->IsCancelled(); });
  if (!state.ok()) return ToGrpcStatus(state.status());
  response->set_state(*state);
  return grpc::Status::OK;
}

grpc::Status AgentService::Restore(grpc::ServerContext* context, const v1::RestoreRequest* request,
                                   v1::RestoreResponse* response) {
  const absl::StatusOr<CallerGate::Pass> admitted = Admit(*context, request->rank());
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (absl::Status valid = CheckRestore(*request); !valid.ok()) return ToGrpcStatus(valid);
  std::optional<int64_t> step;
  if (request->has_step()) step = request->step();
  absl::StatusOr<v1::RestoreResponse> restored;
  if (request->has_source_rank() && request->source_rank() != request->rank()) {
    restored = cluster_ != nullptr
                   ? cluster_->RestoreFrom(request->rank(), request->source_rank(),
                                           Names(request->regions()))
                   : store_->RestoreFromRank(request->rank(), request->source_rank(),
                                             Names(request->regions()));
  } else {
    // From memory once this node holds its share of the committed state, or from the durable tier
    // when memory lost it.
    // A replica group's pieces held by other nodes come from them (or from a lost one's parity).
    std::vector<GroupRegion> remote;
    restored = tiers_->Restore(request->rank(), step, Names(request->regions()),
                               DeadlineOf(context), cluster_ != nullptr ? &remote : nullptr);
    if (restored.ok() && !remote.empty()) {
      const uint32_t rank = request->rank();
      absl::Status fetched = FetchRemotePieces(
          remote,
          [&](uint32_t member, const std::vector<std::string>& regions) {
            return cluster_->RestoreFrom(rank, member, regions);
          },
          &*restored);
      if (!fetched.ok()) restored = fetched;
    }
  }
  if (!restored.ok()) return ToGrpcStatus(restored.status());
  *response = *std::move(restored);
  return grpc::Status::OK;
}

grpc::Status AgentService::LatestCommitted(grpc::ServerContext* context,
                                           const v1::LatestCommittedRequest* request,
                                           v1::LatestCommittedResponse* response) {
  const absl::StatusOr<CallerGate::Pass> admitted = Admit(*context, request->rank());
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  // A replacement node answers once its rebuild has brought back what the group committed; with
  // the committed state gone from memory, from the durable tier.
  absl::StatusOr<v1::LatestCommittedResponse> latest =
      tiers_->LatestCommitted(request->rank(), DeadlineOf(context));
  if (!latest.ok()) return ToGrpcStatus(latest.status());
  *response = *std::move(latest);
  return grpc::Status::OK;
}

grpc::Status AgentService::AppendLog(grpc::ServerContext* context, const v1::AppendLogRequest* request,
                                     v1::AppendLogResponse* response) {
  const absl::StatusOr<CallerGate::Pass> admitted = Admit(*context, request->record().rank());
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (absl::Status valid = CheckAppendLog(*request); !valid.ok()) return ToGrpcStatus(valid);
  absl::StatusOr<v1::AppendLogResponse> appended =
      log_->Append(request->record());
  if (!appended.ok()) return ToGrpcStatus(appended.status());
  *response = *std::move(appended);
  return grpc::Status::OK;
}

grpc::Status AgentService::FetchLog(grpc::ServerContext*, const v1::FetchLogRequest* request,
                                    v1::FetchLogResponse* response) {
  if (absl::Status valid = CheckFetchLog(*request); !valid.ok()) return ToGrpcStatus(valid);
  absl::StatusOr<v1::FetchLogResponse> fetched = log_->Fetch(*request);
  if (absl::IsNotFound(fetched.status()) && cluster_ != nullptr) {
    fetched = cluster_->FetchLog(*request);  // the rank ran on another node
  }
  if (!fetched.ok()) return ToGrpcStatus(fetched.status());
  *response = *std::move(fetched);
  return grpc::Status::OK;
}

grpc::Status AdminService::Status(grpc::ServerContext*, const v1::StatusRequest*,
                                  v1::StatusResponse* response) {
  *response = store_->Status();
  for (v1::OperationProgress& operation : ProgressBoard::Default().Running()) {
    *response->add_operations() = std::move(operation);
  }
  response->set_pid(static_cast<uint32_t>(getpid()));
  response->set_node_id(node_id_);
  response->set_pool_locked(pool_locked_);
  *response->mutable_durable() = tiers_->DurableStatus();
  return grpc::Status::OK;
}

grpc::Status AdminService::ListSteps(grpc::ServerContext*, const v1::ListStepsRequest*,
                                     v1::ListStepsResponse* response) {
  *response = store_->ListSteps();
  return grpc::Status::OK;
}

grpc::Status AdminService::InspectStep(grpc::ServerContext*, const v1::InspectStepRequest* request,
                                       v1::InspectStepResponse* response) {
  if (absl::Status valid = CheckInspectStep(*request); !valid.ok()) return ToGrpcStatus(valid);
  std::optional<uint32_t> rank;
  if (request->has_rank()) rank = request->rank();
  *response = store_->InspectStep(request->step(), rank);
  if (response->steps_size() == 0) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        "step " + std::to_string(request->step()) + " is not stored");
  }
  if (cluster_ != nullptr && response->replica_groups_size() > 0) {
    const std::map<uint32_t, uint32_t> holders = cluster::RankHolders(*store_->ClusterRecord());
    for (v1::RankReplicaGroup& group : *response->mutable_replica_groups()) {
      for (uint32_t member : group.layout().group().ranks()) {
        if (auto holder = holders.find(member); holder != holders.end()) {
          (*group.mutable_member_nodes())[member] = holder->second;
        }
      }
    }
  }
  return grpc::Status::OK;
}

grpc::Status AdminService::ListWindows(grpc::ServerContext*, const v1::ListWindowsRequest* request,
                                       v1::ListWindowsResponse* response) {
  std::optional<uint32_t> rank;
  if (request->has_rank()) rank = request->rank();
  *response = store_->ListWindows(rank);
  log_->Describe(response);
  return grpc::Status::OK;
}

grpc::Status AdminService::Verify(grpc::ServerContext*, const v1::VerifyRequest* request,
                                  v1::VerifyResponse* response) {
  if (absl::Status valid = CheckVerify(*request); !valid.ok()) return ToGrpcStatus(valid);
  std::optional<int64_t> step;
  if (request->has_step()) step = request->step();
  if (cluster_ == nullptr) {
    if (request->repair()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "repair rebuilds chunks from the group's parity, and this daemon serves a "
                          "single node without parity");
    }
    *response = store_->Verify(step);
    return grpc::Status::OK;
  }
  absl::StatusOr<v1::VerifyResponse> verified = cluster_->Verify(step, request->repair());
  if (!verified.ok()) return ToGrpcStatus(verified.status());
  *response = *std::move(verified);
  return grpc::Status::OK;
}

grpc::Status AdminService::ClusterStatus(grpc::ServerContext*, const v1::ClusterStatusRequest*,
                                         v1::ClusterStatusResponse* response) {
  if (cluster_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "this daemon serves a single node (its config has no [cluster])");
  }
  *response = cluster_->Status();
  return grpc::Status::OK;
}

grpc::Status AdminService::Rebuild(grpc::ServerContext*, const v1::RebuildRequest* request,
                                   v1::RebuildResponse* response) {
  if (cluster_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "this daemon serves a single node (its config has no [cluster])");
  }
  absl::StatusOr<v1::RebuildResponse> rebuilt = cluster_->Rebuild(request->node_id());
  if (!rebuilt.ok()) return ToGrpcStatus(rebuilt.status());
  *response = *std::move(rebuilt);
  return grpc::Status::OK;
}

grpc::Status AdminService::DropStep(grpc::ServerContext*, const v1::DropStepRequest* request,
                                    v1::DropStepResponse* response) {
  if (absl::Status valid = CheckDropStep(*request); !valid.ok()) return ToGrpcStatus(valid);
  std::optional<uint32_t> rank;
  if (request->has_rank()) rank = request->rank();
  absl::StatusOr<v1::DropStepResponse> dropped = store_->DropStep(request->step(), rank);
  if (!dropped.ok()) return ToGrpcStatus(dropped.status());
  *response = *std::move(dropped);
  return grpc::Status::OK;
}

grpc::Status AdminService::DropRank(grpc::ServerContext*, const v1::DropRankRequest* request,
                                    v1::DropRankResponse*) {
  return ToGrpcStatus(store_->DropRank(request->rank()));
}

}  // namespace moesnap::daemon

namespace moesnap::daemon {

grpc::Status AdminService::ListDurable(grpc::ServerContext*, const v1::ListDurableRequest*,
                                       v1::ListDurableResponse* response) {
  *response = tiers_->ListDurable();
  return grpc::Status::OK;
}

grpc::Status AdminService::RestoreTier(grpc::ServerContext* context,
                                       const v1::RestoreTierRequest* request,
                                       v1::RestoreTierResponse* response) {
  absl::StatusOr<v1::RestoreTierResponse> tier = tiers_->Tier(request->rank(), DeadlineOf(context));
  if (!tier.ok()) return ToGrpcStatus(tier.status());
  *response = *std::move(tier);
  return grpc::Status::OK;
}

grpc::Status AdminService::Export(grpc::ServerContext* context, const v1::ExportRequest* request,
                                  grpc::ServerWriter<v1::ExportChunk>* writer) {
  if (absl::Status valid = CheckExport(*request); !valid.ok()) return ToGrpcStatus(valid);
  return ToGrpcStatus(tiers_->Export(*request, [context, writer](const v1::ExportChunk& chunk) {
    return !context->IsCancelled() && writer->Write(chunk);
  }));
}

}  // namespace moesnap::daemon
