// Client: the Agent protocol over gRPC on the daemon's Unix socket. Registrations are remembered so
// that Reconnect can replay them to a restarted daemon.
#include "moesnap/client.h"

#include <grpcpp/grpcpp.h>

#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "client/src/device_regions.h"
#include "common/grpc_status.h"
#include "erasure/crc32c.h"
#include "proto/moesnap.grpc.pb.h"

namespace moesnap {

struct Client::State {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Agent::Stub> stub;
  v1::HelloResponse hello;

  std::mutex mutex;  // guards the registrations below
  std::map<std::string, v1::RegionSpec> regions;
  std::map<std::string, std::shared_ptr<SharedBuffer>> buffers;  // keeps host regions mapped
  std::unique_ptr<DeviceRegions> device_regions = CreateDeviceRegions();

  void SetDeadline(grpc::ClientContext& context, std::chrono::milliseconds timeout) const {
    context.set_deadline(std::chrono::system_clock::now() + timeout);
  }

  // Adds the socket to errors that mean "no daemon there", so the caller knows where it looked.
  absl::Status Check(const grpc::Status& status, const char* call) const {
    if (status.ok()) return absl::OkStatus();
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      return absl::UnavailableError(absl::StrCat(
          "moesnapd at ", options.socket_path, " is not answering ", call,
          " (is the daemon running?): ", status.error_message()));
    }
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::DeadlineExceededError(absl::StrCat(
          "moesnapd at ", options.socket_path, " did not complete ", call,
          " in time (is the daemon running? is the socket path right?)"));
    }
    return FromGrpcStatus(status);
  }

  absl::Status Hello() {
    grpc::ClientContext context;
    SetDeadline(context, options.call_timeout);
    context.set_wait_for_ready(true);  // ride out a daemon that is still binding its socket
    v1::HelloRequest request;
    request.set_rank(options.rank);
    return Check(stub->Hello(&context, request, &hello), "Hello");
  }

  absl::Status Wait(int64_t step, bool until_committed) {
    grpc::ClientContext context;
    SetDeadline(context, options.wait_timeout);
    v1::WaitRequest request;
    request.set_rank(options.rank);
    request.set_step(step);
    v1::WaitResponse response;
    return until_committed
               ? Check(stub->WaitCommitted(&context, request, &response), "WaitCommitted")
               : Check(stub->WaitCaptured(&context, request, &response), "WaitCaptured");
  }

  // The latest committed step and the sparse windows: one call answers both.
  absl::StatusOr<v1::LatestCommittedResponse> LatestCommitted() {
    grpc::ClientContext context;
    SetDeadline(context, options.call_timeout);
    v1::LatestCommittedRequest request;
    request.set_rank(options.rank);
    v1::LatestCommittedResponse response;
    if (absl::Status status =
            Check(stub->LatestCommitted(&context, request, &response), "LatestCommitted");
        !status.ok()) {
      return status;
    }
    return response;
  }

  absl::Status Register(const v1::RegionSpec& spec) {
    grpc::ClientContext context;
    SetDeadline(context, options.call_timeout);
    v1::RegisterRegionsRequest request;
    request.set_rank(options.rank);
    *request.add_regions() = spec;
    v1::RegisterRegionsResponse response;
    return Check(stub->RegisterRegions(&context, request, &response), "RegisterRegions");
  }
};

Client::Client(std::unique_ptr<State> state) : state_(std::move(state)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto state = std::make_unique<State>();
  state->options = options;
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(64 << 20);
  state->channel = grpc::CreateCustomChannel("unix:" + options.socket_path,
                                             grpc::InsecureChannelCredentials(), arguments);
  state->stub = v1::Agent::NewStub(state->channel);
  if (absl::Status status = state->Hello(); !status.ok()) return status;
  return std::unique_ptr<Client>(new Client(std::move(state)));
}

absl::StatusOr<std::shared_ptr<SharedBuffer>> Client::AllocateHost(size_t bytes) const {
  return SharedBuffer::Allocate(bytes, state_->hello.shm_group());
}

absl::Status Client::RegisterHostRegion(const RegionInfo& info, std::shared_ptr<SharedBuffer> buffer,
                                        size_t offset, size_t bytes) {
  if (buffer == nullptr) return absl::InvalidArgumentError("null buffer for region '" + info.name + "'");
  if (offset + bytes > buffer->size() || offset + bytes < bytes) {
    return absl::InvalidArgumentError(absl::StrCat("region '", info.name, "' [", offset, ", +", bytes,
                                                   ") lies outside its ", buffer->size(),
                                                   "-byte buffer"));
  }
  v1::RegionSpec spec;
  spec.set_name(info.name);
  spec.set_device(v1::DEVICE_HOST);
  spec.set_bytes(bytes);
  spec.set_dtype(info.dtype);
  for (int64_t dimension : info.shape) spec.add_shape(dimension);
  spec.mutable_handle()->set_shm_name(buffer->name());
  spec.mutable_handle()->set_shm_offset(offset);
  if (absl::Status status = state_->Register(spec); !status.ok()) return status;
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->regions[info.name] = spec;
  state_->buffers[info.name] = std::move(buffer);
  return absl::OkStatus();
}

absl::Status Client::RegisterDeviceRegion(const RegionInfo& info, const DeviceMemory& memory) {
  if (!state_->hello.supports_device_memory()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "region '", info.name, "' is GPU memory but moesnapd at ", state_->options.socket_path,
        " has no CUDA copy backend"));
  }
  absl::StatusOr<v1::RegionHandle> handle = state_->device_regions->Share(info.name, memory);
  if (!handle.ok()) return handle.status();
  v1::RegionSpec spec;
  spec.set_name(info.name);
  spec.set_device(v1::DEVICE_CUDA);
  spec.set_bytes(memory.bytes);
  spec.set_dtype(info.dtype);
  for (int64_t dimension : info.shape) spec.add_shape(dimension);
  *spec.mutable_handle() = *std::move(handle);
  if (absl::Status status = state_->Register(spec); !status.ok()) return status;
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->regions[info.name] = spec;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Client::Snapshot(int64_t step, const std::vector<std::string>& regions) {
  v1::SnapshotRequest request;
  request.set_step(step);
  return SnapshotWith(std::move(request), regions);
}

absl::StatusOr<uint64_t> Client::SnapshotSparse(int64_t step, const std::vector<std::string>& regions,
                                                const SparseSlot& slot) {
  v1::SnapshotRequest request;
  request.set_step(step);
  v1::SparseSlot* sparse = request.mutable_sparse();
  sparse->set_window_first_step(slot.window_first_step);
  sparse->set_window_size(slot.window_size);
  sparse->set_slot(slot.slot);
  sparse->set_buffer(slot.buffer);
  for (const std::string& name : slot.operators) sparse->add_operators(name);
  return SnapshotWith(std::move(request), regions);
}

absl::StatusOr<uint64_t> Client::SnapshotWith(v1::SnapshotRequest request,
                                              const std::vector<std::string>& regions) {
  if (absl::Status status = state_->device_regions->RecordCaptureEvents(regions); !status.ok()) {
    return status;
  }
  grpc::ClientContext context;
  state_->SetDeadline(context, state_->options.call_timeout);
  request.set_rank(state_->options.rank);
  for (const std::string& region : regions) request.add_regions(region);
  v1::SnapshotResponse response;
  if (absl::Status status = state_->Check(state_->stub->Snapshot(&context, request, &response),
                                          "Snapshot");
      !status.ok()) {
    return status;
  }
  return response.bytes();
}

absl::Status Client::WaitCaptured(int64_t step) { return state_->Wait(step, false); }

absl::Status Client::WaitCommitted(int64_t step) { return state_->Wait(step, true); }

absl::StatusOr<RestoreResult> Client::Restore(std::optional<int64_t> step,
                                              const std::vector<std::string>& regions) {
  v1::RestoreRequest request;
  if (step) request.set_step(*step);
  return RestoreWith(request, regions);
}

absl::StatusOr<RestoreResult> Client::RestoreFrom(uint32_t source_rank,
                                                  const std::vector<std::string>& regions) {
  v1::RestoreRequest request;
  request.set_source_rank(source_rank);
  return RestoreWith(request, regions);
}

absl::StatusOr<RestoreResult> Client::RestoreWith(v1::RestoreRequest request,
                                                  const std::vector<std::string>& regions) {
  grpc::ClientContext context;
  state_->SetDeadline(context, state_->options.wait_timeout);
  request.set_rank(state_->options.rank);
  for (const std::string& region : regions) request.add_regions(region);
  v1::RestoreResponse response;
  if (absl::Status status = state_->Check(state_->stub->Restore(&context, request, &response),
                                          "Restore");
      !status.ok()) {
    return status;
  }
  RestoreResult result;
  result.step = response.step();
  for (const auto& restored : response.regions()) {
    result.regions.push_back({restored.region(), restored.step(), restored.bytes()});
  }
  result.tier = response.tier() == v1::TIER_DURABLE ? RestoreTier::kDurable : RestoreTier::kMemory;
  return result;
}

absl::StatusOr<std::optional<int64_t>> Client::LatestCommitted() {
  absl::StatusOr<v1::LatestCommittedResponse> response = state_->LatestCommitted();
  if (!response.ok()) return response.status();
  if (!response->has_step()) return std::optional<int64_t>();
  return std::optional<int64_t>(response->step());
}

namespace {

SparseWindow WindowFrom(const v1::SparseWindow& saved) {
  SparseWindow window;
  window.first_step = saved.first_step();
  window.size = saved.size();
  window.buffer = saved.buffer();
  window.failure = saved.failure();
  for (const v1::WindowSlot& slot : saved.slots()) {
    window.slots.push_back({slot.slot(), slot.step(), slot.state() == v1::STEP_STATE_COMMITTED,
                            {slot.operators().begin(), slot.operators().end()}});
  }
  return window;
}

v1::LogDirection ToWire(LogDirection direction) {
  return direction == LogDirection::kForward ? v1::LOG_DIRECTION_FORWARD
                                             : v1::LOG_DIRECTION_BACKWARD;
}

}  // namespace

absl::StatusOr<SparseWindows> Client::Windows() {
  absl::StatusOr<v1::LatestCommittedResponse> response = state_->LatestCommitted();
  if (!response.ok()) return response.status();
  SparseWindows windows;
  if (response->has_committed_window()) windows.committed = WindowFrom(response->committed_window());
  if (response->has_open_window()) windows.open = WindowFrom(response->open_window());
  return windows;
}

absl::Status Client::AppendLog(int64_t step, uint32_t micro_batch, LogDirection direction,
                               uint32_t peer_rank, std::string_view payload) {
  grpc::ClientContext context;
  state_->SetDeadline(context, state_->options.call_timeout);
  v1::AppendLogRequest request;
  v1::LogRecord* record = request.mutable_record();
  record->set_rank(state_->options.rank);
  record->set_step(step);
  record->set_micro_batch(micro_batch);
  record->set_direction(ToWire(direction));
  record->set_peer_rank(peer_rank);
  record->set_payload(std::string(payload));
  v1::AppendLogResponse response;
  return state_->Check(state_->stub->AppendLog(&context, request, &response), "AppendLog");
}

absl::StatusOr<std::vector<LoggedMessage>> Client::FetchLog(uint32_t sender_rank, int64_t step,
                                                            LogDirection direction,
                                                            uint32_t peer_rank) {
  grpc::ClientContext context;
  state_->SetDeadline(context, state_->options.wait_timeout);
  v1::FetchLogRequest request;
  request.set_rank(sender_rank);
  request.set_step(step);
  request.set_direction(ToWire(direction));
  request.set_peer_rank(peer_rank);
  v1::FetchLogResponse response;
  if (absl::Status status =
          state_->Check(state_->stub->FetchLog(&context, request, &response), "FetchLog");
      !status.ok()) {
    return status;
  }
  std::vector<LoggedMessage> messages;
  for (v1::LogRecord& record : *response.mutable_records()) {
    const uint32_t crc = erasure::Crc32c(record.payload().data(), record.payload().size());
    if (crc != record.crc()) {
      return absl::DataLossError(absl::StrCat(
          "logged message of step ", step, " micro-batch ", record.micro_batch(), " from rank ",
          sender_rank, " arrived from node ", response.node_id(), " with CRC-32C ",
          absl::Hex(crc), ", not ", absl::Hex(record.crc())));
    }
    messages.push_back({record.micro_batch(), std::move(*record.mutable_payload())});
  }
  return messages;
}

absl::Status Client::Reconnect() {
  if (absl::Status status = state_->Hello(); !status.ok()) return status;
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (const auto& [name, spec] : state_->regions) {
    if (absl::Status status = state_->Register(spec); !status.ok()) return status;
  }
  return absl::OkStatus();
}

uint32_t Client::rank() const { return state_->options.rank; }
uint32_t Client::node_id() const { return state_->hello.node_id(); }
const std::string& Client::shm_group() const { return state_->hello.shm_group(); }

}  // namespace moesnap
