// Client: the Agent protocol over gRPC on the daemon's Unix socket, and the memory handoff beside
// it. What was shared and registered is remembered so that a restarted daemon gets all of it again.
#include "moesnap/client.h"

#include <grpcpp/grpcpp.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "client/src/daemon_probe.h"
#include "client/src/device_regions.h"
#include "client/src/memory_channel.h"
#include "common/memory_handoff_wire.h"
#include "common/grpc_status.h"
#include "erasure/crc32c.h"
#include "proto/moesnap.grpc.pb.h"
#include "proto/restored_regions.h"

namespace moesnap {
namespace {

// Regions per RegisterRegions call: a few MB of specs, far below the message limit.
constexpr size_t kRegionsPerCall = 8192;
// Steps whose session is remembered, to tell a capture lost with a daemon from a wrong step.
constexpr size_t kStepsRemembered = 64;
// How long a daemon that serves may take to answer the health check that follows a call that ran out
// of time (gRPC answers it on a thread of its own, whatever the daemon's calls are doing).
constexpr std::chrono::milliseconds kHealthCheckTimeout{1000};

}  // namespace

absl::StatusOr<ClientOptions> ClientOptions::FromEnvironment() {
  ClientOptions options;
  if (const char* socket = std::getenv("MOESNAP_SOCKET"); socket != nullptr && *socket != '\0') {
    options.socket_path = socket;
  }
  for (const char* variable : {"RANK", "LOCAL_RANK"}) {
    const char* value = std::getenv(variable);
    if (value == nullptr || *value == '\0') continue;
    if (!absl::SimpleAtoi(value, &options.rank)) {
      return absl::InvalidArgumentError(
          absl::StrCat(variable, "='", value, "' is not a rank (a number from 0)"));
    }
    break;
  }
  return options;
}

struct Client::State {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Agent::Stub> stub;
  std::unique_ptr<DeviceRegions> device_regions = std::make_unique<DeviceRegions>();
  std::unique_ptr<DaemonProbe> probe;  // on `channel`

  std::mutex mutex;  // guards everything below
  v1::HelloResponse hello;
  MemoryChannel memory;
  uint64_t session = 0;  // sessions started, counting the first
  struct Shared {
    int fd = -1;
    uint64_t daemon_id = 0;
  };
  std::vector<Shared> shared;  // MemoryHandle h is shared[h - 1]
  std::map<const SharedBuffer*, MemoryHandle> buffer_handles;
  std::map<std::string, std::shared_ptr<SharedBuffer>> buffers;  // keeps host regions mapped
  std::vector<std::shared_ptr<SharedBuffer>> adopted_buffers;    // kept mapped while this lives
  // Every registration, host regions naming their MemoryHandle in handle.memory.
  std::map<std::string, v1::RegionSpec> regions;
  // A snapshot the daemon took: in which session, and the call's take (its number among this
  // client's Snapshot calls, from 1).
  struct Taken {
    uint64_t session = 0;
    uint64_t take = 0;
  };
  std::map<int64_t, Taken> taken_steps;  // by step
  std::optional<int64_t> last_taken;     // the latest snapshot the daemon took
  uint64_t takes = 0;                    // Snapshot calls made
  // The count the daemon reads when a capture's copy ends (v1::AbandonMark): raised to a take
  // before the caller goes on without having heard that its capture ended, so that a capture the
  // caller may have written over meanwhile is aborted, never committed. Handed to every session.
  std::shared_ptr<SharedBuffer> abandon_mark;
  MemoryHandle abandon_mark_handle = 0;
  std::vector<std::pair<int64_t, std::string>> skipped_steps;

  // The session the daemon bound this rank to at Hello, presented on every call (the daemon refuses
  // calls without it). Its own lock: calls are prepared with and without `mutex` held.
  mutable std::mutex session_token_mutex;
  std::string session_token;

  void PrepareCall(grpc::ClientContext& context, std::chrono::milliseconds timeout) const {
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    std::lock_guard<std::mutex> lock(session_token_mutex);
    if (!session_token.empty()) context.AddMetadata(memory_handoff::kSessionMetadataKey, session_token);
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
      probe->RanOut(call);  // a slow step, or a daemon that serves nothing: the probe tells
      return absl::DeadlineExceededError(absl::StrCat(
          "moesnapd at ", options.socket_path, " did not complete ", call, " in time"));
    }
    return FromGrpcStatus(status);
  }

  // Starts a session: Hello, then the memory channel. Fails at once when no daemon listens.
  absl::Status StartSessionLocked() {
    struct stat info {};
    if (stat(options.socket_path.c_str(), &info) != 0) {
      return absl::UnavailableError(absl::StrCat("no moesnapd socket at ", options.socket_path,
                                                 " (is the daemon running? set MOESNAP_SOCKET "
                                                 "or the socket path to where it listens)"));
    }
    grpc::ClientContext context;
    PrepareCall(context, options.call_timeout);
    v1::HelloRequest request;
    request.set_rank(options.rank);
    v1::HelloResponse response;
    if (absl::Status status = Check(stub->Hello(&context, request, &response), "Hello");
        !status.ok()) {
      return status;
    }
    absl::StatusOr<MemoryChannel> channel_to_memory =
        MemoryChannel::Connect(response.memory_socket(), response.session(), options.call_timeout);
    if (!channel_to_memory.ok()) return channel_to_memory.status();
    {
      std::lock_guard<std::mutex> lock(session_token_mutex);
      session_token = response.session();
    }
    hello = std::move(response);
    memory = *std::move(channel_to_memory);
    ++session;
    return absl::OkStatus();
  }

  absl::Status RegisterLocked(std::vector<v1::RegionSpec> specs) {
    for (size_t done = 0; done < specs.size(); done += kRegionsPerCall) {
      v1::RegisterRegionsRequest request;
      request.set_rank(options.rank);
      for (size_t i = done; i < std::min(specs.size(), done + kRegionsPerCall); ++i) {
        v1::RegionSpec* spec = request.add_regions();
        *spec = specs[i];
        if (spec->device() == v1::DEVICE_HOST) {
          spec->mutable_handle()->set_memory(shared[spec->handle().memory() - 1].daemon_id);
        }
      }
      grpc::ClientContext context;
      PrepareCall(context, options.call_timeout);
      v1::RegisterRegionsResponse response;
      if (absl::Status status =
              Check(stub->RegisterRegions(&context, request, &response), "RegisterRegions");
          !status.ok()) {
        return status;
      }
    }
    return absl::OkStatus();
  }

  // A new session with everything handed over and registered again.
  absl::Status ReconnectLocked() {
    if (absl::Status status = StartSessionLocked(); !status.ok()) return status;
    absl::Status handed_over = HandOverLocked();
    // A session without everything handed over is ended (its memory channel closed), so that the
    // next call connects again instead of using it.
    if (!handed_over.ok()) memory = MemoryChannel();
    return handed_over;
  }

  absl::Status HandOverLocked() {
    std::vector<int> fds;
    for (const Shared& entry : shared) fds.push_back(entry.fd);
    absl::StatusOr<std::vector<uint64_t>> ids = memory.Share(fds);
    if (!ids.ok()) return ids.status();
    for (size_t i = 0; i < shared.size(); ++i) shared[i].daemon_id = (*ids)[i];
    std::vector<v1::RegionSpec> specs;
    for (const auto& [name, spec] : regions) specs.push_back(spec);
    return RegisterLocked(std::move(specs));
  }

  // Refuses `call` at once while the daemon answers nothing (DaemonProbe). Before `call`, and
  // again when it fails as unavailable: when the daemon this session handed its memory to is gone
  // (its end of the memory channel closed), connects to the daemon serving the socket now and hands
  // everything over again. gRPC itself reconnects to a restarted daemon silently, so the memory
  // channel is what tells that the daemon changed. One poll, no I/O.
  template <typename Call>
  auto WithReconnect(Call call) -> decltype(call()) {
    if (absl::Status answering = probe->Admit(); !answering.ok()) return answering;
    if (absl::Status ready = ReconnectIfGone(); !ready.ok()) return ready;
    auto result = call();
    if (result.ok() || !absl::IsUnavailable(Status(result))) return result;
    bool reconnected = false;
    if (absl::Status ready = ReconnectIfGone(&reconnected); !ready.ok()) {
      return absl::UnavailableError(
          absl::StrCat(Status(result).message(), "; connecting again failed: ", ready.message()));
    }
    return reconnected ? call() : result;
  }

  // Registers `specs` and keeps them, to be registered again by a reconnect.
  absl::Status RegisterAndKeep(std::vector<v1::RegionSpec> specs) {
    absl::Status status = WithReconnect([&] {
      std::lock_guard<std::mutex> lock(mutex);
      return RegisterLocked(specs);
    });
    if (!status.ok()) return status;
    std::lock_guard<std::mutex> lock(mutex);
    for (v1::RegionSpec& spec : specs) regions[spec.name()] = std::move(spec);
    return absl::OkStatus();
  }

  absl::Status ReconnectIfGone(bool* reconnected = nullptr) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!memory.PeerClosed()) return absl::OkStatus();
    if (reconnected != nullptr) *reconnected = true;
    return ReconnectLocked();
  }

  // The caller goes on without having heard that `step`'s capture ended (a wait for it failed, or
  // the daemon did not answer the Snapshot call): the capture, if it still copies, is no snapshot.
  void AbandonLocked(uint64_t take) {
    std::atomic_ref<uint64_t> count(*reinterpret_cast<uint64_t*>(abandon_mark->data()));
    uint64_t seen = count.load();
    while (seen < take && !count.compare_exchange_weak(seen, take)) {
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);  // before the caller writes its memory
  }

  // Whether `step`, taken by this rank, went away with the daemon that took it: that session ended
  // (the daemon's end of the memory channel closed, or another session began since).
  bool LostWithItsDaemonLocked(int64_t step) const {
    auto it = taken_steps.find(step);
    return memory.PeerClosed() || it == taken_steps.end() || it->second.session != session;
  }

  static absl::Status Status(const absl::Status& status) { return status; }
  template <typename T>
  static absl::Status Status(const absl::StatusOr<T>& result) {
    return result.status();
  }

  // The latest committed step and the sparse windows: one call answers both.
  absl::StatusOr<v1::LatestCommittedResponse> LatestCommitted() {
    return WithReconnect([&]() -> absl::StatusOr<v1::LatestCommittedResponse> {
      grpc::ClientContext context;
      PrepareCall(context, options.call_timeout);
      v1::LatestCommittedRequest request;
      request.set_rank(options.rank);
      v1::LatestCommittedResponse response;
      if (absl::Status status =
              Check(stub->LatestCommitted(&context, request, &response), "LatestCommitted");
          !status.ok()) {
        return status;
      }
      return response;
    });
  }
};

Client::Client(std::unique_ptr<State> state) : state_(std::move(state)) {}
Client::~Client() {
  // Nothing more is heard of the captures still copying: the caller may change its memory now.
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->AbandonLocked(state_->takes);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto state = std::make_unique<State>();
  state->options = options;
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(64 << 20);
  // The daemon is a local socket that comes back within a second when restarted (an upgrade,
  // systemd's restart): try it again soon, instead of gRPC's default backoff of up to two
  // minutes, during which every call would fail without trying.
  // (Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC takes it as the connect timeout too, and a
  // loaded machine may take longer than a backoff to answer.)
  arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  state->channel = grpc::CreateCustomChannel("unix:" + options.socket_path,
                                             grpc::InsecureChannelCredentials(), arguments);
  state->stub = v1::Agent::NewStub(state->channel);
  state->probe = std::make_unique<DaemonProbe>(state->channel, options.socket_path,
                                               std::min(options.call_timeout, kHealthCheckTimeout),
                                               options.call_timeout);
  absl::StatusOr<std::shared_ptr<SharedBuffer>> abandon_mark =
      SharedBuffer::Allocate(sizeof(uint64_t), "moesnap-abandon-mark");
  if (!abandon_mark.ok()) return abandon_mark.status();
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    if (absl::Status status = state->StartSessionLocked(); !status.ok()) return status;
    absl::StatusOr<std::vector<uint64_t>> ids = state->memory.Share({(*abandon_mark)->fd()});
    if (!ids.ok()) return ids.status();
    state->shared.push_back({(*abandon_mark)->fd(), ids->front()});
    state->abandon_mark = *std::move(abandon_mark);
    state->abandon_mark_handle = state->shared.size();
  }
  return std::unique_ptr<Client>(new Client(std::move(state)));
}

absl::StatusOr<std::shared_ptr<SharedBuffer>> Client::AllocateHost(size_t bytes) const {
  return SharedBuffer::Allocate(bytes);
}

absl::StatusOr<std::vector<MemoryHandle>> Client::ShareMemory(const std::vector<int>& fds) {
  return state_->WithReconnect([&]() -> absl::StatusOr<std::vector<MemoryHandle>> {
    std::lock_guard<std::mutex> lock(state_->mutex);
    absl::StatusOr<std::vector<uint64_t>> ids = state_->memory.Share(fds);
    if (!ids.ok()) return ids.status();
    std::vector<MemoryHandle> handles;
    for (size_t i = 0; i < fds.size(); ++i) {
      state_->shared.push_back({fds[i], (*ids)[i]});
      handles.push_back(state_->shared.size());
    }
    return handles;
  });
}

absl::StatusOr<std::optional<AdoptedMemory>> Client::AdoptMemory(size_t bytes) {
  return state_->WithReconnect([&]() -> absl::StatusOr<std::optional<AdoptedMemory>> {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->hello.keeps_exited_memory()) return std::nullopt;
    absl::StatusOr<std::optional<MemoryChannel::Adopted>> adopted = state_->memory.Adopt(bytes);
    if (!adopted.ok()) return adopted.status();
    if (!adopted->has_value()) return std::nullopt;
    state_->shared.push_back({(*adopted)->fd, (*adopted)->id});
    return AdoptedMemory{(*adopted)->fd, state_->shared.size()};
  });
}

absl::StatusOr<std::shared_ptr<SharedBuffer>> Client::AdoptHost(size_t bytes) {
  absl::StatusOr<std::optional<AdoptedMemory>> adopted = AdoptMemory(bytes);
  if (!adopted.ok()) return adopted.status();
  if (!adopted->has_value()) return nullptr;
  absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = SharedBuffer::Map((*adopted)->fd, bytes);
  // On failure the descriptor stays open, handed over as the handle says (a reconnection hands
  // every handle's descriptor over again).
  if (!buffer.ok()) return buffer.status();
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->buffer_handles[buffer->get()] = (*adopted)->memory;
  state_->adopted_buffers.push_back(*buffer);
  return *buffer;
}

absl::Status Client::RegisterHostRegions(const std::vector<HostRegion>& regions) {
  std::vector<v1::RegionSpec> specs;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    for (const HostRegion& region : regions) {
      if (region.memory == 0 || region.memory > state_->shared.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "region '", region.info.name, "' names memory handle ", region.memory,
            ", which ShareMemory did not return"));
      }
      v1::RegionSpec spec;
      spec.set_name(region.info.name);
      spec.set_device(v1::DEVICE_HOST);
      spec.set_bytes(region.bytes);
      spec.set_dtype(region.info.dtype);
      for (int64_t dimension : region.info.shape) spec.add_shape(dimension);
      spec.mutable_handle()->set_memory(region.memory);
      spec.mutable_handle()->set_shm_offset(region.offset);
      specs.push_back(std::move(spec));
    }
  }
  return state_->RegisterAndKeep(std::move(specs));
}

absl::Status Client::RegisterHostRegion(const RegionInfo& info, std::shared_ptr<SharedBuffer> buffer,
                                        size_t offset, size_t bytes) {
  if (buffer == nullptr) return absl::InvalidArgumentError("null buffer for region '" + info.name + "'");
  if (offset + bytes > buffer->size() || offset + bytes < bytes) {
    return absl::InvalidArgumentError(absl::StrCat("region '", info.name, "' [", offset, ", +", bytes,
                                                   ") lies outside its ", buffer->size(),
                                                   "-byte buffer"));
  }
  MemoryHandle handle = 0;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (auto it = state_->buffer_handles.find(buffer.get()); it != state_->buffer_handles.end()) {
      handle = it->second;
    }
  }
  if (handle == 0) {
    absl::StatusOr<std::vector<MemoryHandle>> shared = ShareMemory({buffer->fd()});
    if (!shared.ok()) return shared.status();
    handle = shared->front();
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->buffer_handles[buffer.get()] = handle;
  }
  if (absl::Status status = RegisterHostRegions({{info, handle, offset, bytes}}); !status.ok()) {
    return status;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->buffers[info.name] = std::move(buffer);
  return absl::OkStatus();
}

absl::Status Client::SetReplicaGroup(const ReplicaGroup& group,
                                     const std::vector<std::string>& regions) {
  std::vector<v1::RegionSpec> specs;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto set = [&](v1::RegionSpec spec) {
      if (group.ranks.empty()) {
        spec.clear_replica_group();
      } else {
        v1::ReplicaGroup* declared = spec.mutable_replica_group();
        declared->set_name(group.name);
        for (uint32_t rank : group.ranks) declared->add_ranks(rank);
      }
      specs.push_back(std::move(spec));
    };
    if (regions.empty()) {
      for (const auto& [name, spec] : state_->regions) set(spec);
    }
    for (const std::string& name : regions) {
      auto it = state_->regions.find(name);
      if (it == state_->regions.end()) {
        return absl::NotFoundError(absl::StrCat("region '", name, "' of replica group '",
                                                group.name, "' is not registered"));
      }
      set(it->second);
    }
  }
  return state_->RegisterAndKeep(std::move(specs));
}

absl::Status Client::RegisterDeviceRegions(const std::vector<DeviceRegion>& regions) {
  if (regions.empty()) return absl::OkStatus();
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->hello.supports_device_memory()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "region '", regions.front().info.name, "' is GPU memory but moesnapd at ",
          state_->options.socket_path, " has no CUDA copy backend"));
    }
  }
  std::vector<std::pair<std::string, DeviceMemory>> shared;
  shared.reserve(regions.size());
  for (const DeviceRegion& region : regions) shared.emplace_back(region.info.name, region.memory);
  absl::StatusOr<std::vector<v1::RegionHandle>> handles = state_->device_regions->Share(shared);
  if (!handles.ok()) return handles.status();
  absl::Status registered;
  absl::Cleanup end_share = [&] { state_->device_regions->EndShare(shared, registered.ok()); };
  std::vector<v1::RegionSpec> specs;
  specs.reserve(regions.size());
  for (size_t i = 0; i < regions.size(); ++i) {
    v1::RegionSpec& spec = specs.emplace_back();
    spec.set_name(regions[i].info.name);
    spec.set_device(v1::DEVICE_CUDA);
    spec.set_bytes(regions[i].memory.bytes);
    spec.set_dtype(regions[i].info.dtype);
    for (int64_t dimension : regions[i].info.shape) spec.add_shape(dimension);
    *spec.mutable_handle() = std::move((*handles)[i]);
  }
  registered = state_->RegisterAndKeep(std::move(specs));
  return registered;
}

absl::Status Client::RegisterDeviceRegion(const RegionInfo& info, const DeviceMemory& memory) {
  return RegisterDeviceRegions({{info, memory}});
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
  // The caller goes on when the call fails: unless the daemon answered it, it may have taken the
  // step, and an earlier capture may still copy (a Snapshot the daemon sees aborts that one; one
  // not sent, refused while the daemon serves nothing, does not). The mark covers every take on
  // every way out but an answer, an exception (out of memory) included.
  bool answered = false;
  absl::Cleanup abandon_unless_answered = [&] {
    if (answered) return;
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->AbandonLocked(state_->takes);
  };
  if (absl::Status status = state_->device_regions->RecordCaptureEvents(regions); !status.ok()) {
    return status;
  }
  request.set_rank(state_->options.rank);
  for (const std::string& region : regions) request.add_regions(region);
  return state_->WithReconnect([&]() -> absl::StatusOr<uint64_t> {
    State::Taken taken;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      taken = {state_->session, ++state_->takes};
      v1::AbandonMark* mark = request.mutable_abandon_mark();
      mark->set_memory(state_->shared[state_->abandon_mark_handle - 1].daemon_id);
      mark->set_take(taken.take);
    }
    grpc::ClientContext context;
    state_->PrepareCall(context, state_->options.call_timeout);
    v1::SnapshotResponse response;
    const grpc::Status answer = state_->stub->Snapshot(&context, request, &response);
    answered = answer.ok();
    if (!answered) return state_->Check(answer, "Snapshot");
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!response.skipped().empty()) {
      state_->skipped_steps.emplace_back(request.step(), response.skipped());
      return uint64_t{0};
    }
    // Steps from this one on were of a timeline a restore ended: this one replaces them.
    state_->taken_steps.erase(state_->taken_steps.lower_bound(request.step()),
                              state_->taken_steps.end());
    state_->taken_steps[request.step()] = taken;
    state_->last_taken = request.step();
    while (state_->taken_steps.size() > kStepsRemembered) {
      state_->taken_steps.erase(state_->taken_steps.begin());
    }
    return response.bytes();
  });
}

absl::Status Client::Wait(int64_t step, bool until_committed) {
  std::optional<uint64_t> take;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (auto it = state_->taken_steps.find(step); it != state_->taken_steps.end()) {
      take = it->second.take;
    }
  }
  // The caller goes on without having heard that the capture ended: on every way out but an
  // answer, an exception (out of memory) included.
  bool heard = false;
  absl::Cleanup abandon_unless_heard = [&] {
    if (heard || !take) return;
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->AbandonLocked(*take);
  };
  const absl::Status status = WaitWithoutGivingUp(
      step, until_committed, std::chrono::steady_clock::now() + state_->options.wait_timeout);
  heard = status.ok();
  return status;
}

absl::Status Client::WaitWithoutGivingUp(int64_t step, bool until_committed,
                                         std::chrono::steady_clock::time_point deadline) {
  const char* call = until_committed ? "WaitCommitted" : "WaitCaptured";
  // In calls of at most a call timeout each: one that runs out has the daemon's health checked
  // (DaemonProbe), so a daemon that answers nothing ends the wait after one such call, not after
  // the whole wait timeout.
  absl::Status status;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 && !status.ok()) break;  // the last call's answer stands
    status = state_->WithReconnect([&] {
      grpc::ClientContext context;
      state_->PrepareCall(context, std::min(left, state_->options.call_timeout));
      v1::WaitRequest request;
      request.set_rank(state_->options.rank);
      request.set_step(step);
      v1::WaitResponse response;
      return until_committed
                 ? state_->Check(state_->stub->WaitCommitted(&context, request, &response), call)
                 : state_->Check(state_->stub->WaitCaptured(&context, request, &response), call);
    });
    if (!absl::IsDeadlineExceeded(status) || left <= state_->options.call_timeout) break;
  }
  if (status.ok()) return status;
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto it = state_->taken_steps.find(step);
  if (!absl::IsNotFound(status)) return status;
  // Snapshotted in an earlier session: its capture went away with that daemon.
  if (it == state_->taken_steps.end() || it->second.session == state_->session) return status;
  const std::string reason = absl::StrCat("moesnapd at ", state_->options.socket_path,
                                          " restarted before step ", step, " was ",
                                          until_committed ? "committed" : "captured");
  state_->taken_steps.erase(it);
  state_->skipped_steps.emplace_back(step, reason);
  // The regions are free to change: nothing copies them any more. A commit will never come.
  return until_committed ? absl::AbortedError(reason) : absl::OkStatus();
}

absl::Status Client::WaitCaptured(int64_t step) { return Wait(step, false); }

absl::Status Client::Commit(int64_t step) {
  // Its waits give nothing up while it tries: the caller goes on only when it returns, and then,
  // unless `step` committed, nothing it took may commit after its memory changed.
  bool committed = false;
  absl::Cleanup abandon_unless_committed = [&] {
    if (committed) return;
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->AbandonLocked(state_->takes);
  };
  absl::Status status = CommitTrying(step);
  committed = status.ok();
  if (committed) {  // taken again after a skip or a daemon lost: its skips are no news
    std::lock_guard<std::mutex> lock(state_->mutex);
    std::erase_if(state_->skipped_steps,
                  [step](const auto& skipped) { return skipped.first == step; });
  }
  return status;
}

absl::Status Client::CommitTrying(int64_t step) {
  const auto deadline = std::chrono::steady_clock::now() + state_->options.wait_timeout;
  std::chrono::milliseconds retry_pause(10);
  const auto ran_out = [&](absl::string_view why) {
    return absl::DeadlineExceededError(absl::StrCat(
        "step ", step, " of rank ", state_->options.rank, " could not be committed within ",
        state_->options.wait_timeout.count(), " ms: ", why));
  };
  while (true) {
    const std::optional<int64_t> last_taken = [&] {
      std::lock_guard<std::mutex> lock(state_->mutex);
      return state_->last_taken;
    }();
    if (last_taken == step) {
      const absl::Status committed = WaitWithoutGivingUp(step, /*until_committed=*/true, deadline);
      if (committed.ok()) return committed;
      std::unique_lock<std::mutex> lock(state_->mutex);
      // The wait forgets a step lost with a daemon restarted since (its ABORTED is the client's).
      const bool forgotten = !state_->taken_steps.contains(step);
      if (!forgotten && !absl::IsUnavailable(committed)) {
        // The daemon's answer: a step the cluster aborted cannot be taken again (its decision is
        // final), and a wait that ran out is the end.
        return committed;
      }
      if (state_->LostWithItsDaemonLocked(step)) {
        // Taken here but lost with a daemon that went away: take it again.
        if (state_->last_taken == step) state_->last_taken.reset();
      } else {
        // Refused while the daemon that took the step serves nothing (DaemonProbe): it is not
        // gone, may still commit the step, and would refuse it taken again. Wait for it again.
        lock.unlock();
        if (std::chrono::steady_clock::now() >= deadline) return ran_out(committed.message());
        std::this_thread::sleep_for(retry_pause);
        retry_pause = std::min(retry_pause * 2, std::chrono::milliseconds(1000));
        continue;
      }
    }
    // A step taken before this try, other than `step` itself (lost with its daemon).
    const bool earlier_taken = last_taken && *last_taken != step;
    // Committed already: this process restored `step` and took nothing after it.
    if (absl::StatusOr<std::optional<int64_t>> latest = LatestCommitted();
        latest.ok() && *latest == step) {
      return absl::OkStatus();
    }
    constexpr absl::string_view kSkipped = "its snapshots were skipped (TakeSkippedSteps says why)";
    if (std::chrono::steady_clock::now() >= deadline) return ran_out(kSkipped);
    // Earlier steps settle (committed, superseded or aborted) before the step is taken again.
    if (earlier_taken) {
      (void)WaitWithoutGivingUp(*last_taken, /*until_committed=*/true, deadline);
      if (std::chrono::steady_clock::now() >= deadline) return ran_out(kSkipped);
    }
    absl::StatusOr<uint64_t> snapshot = Snapshot(step);
    // The daemon restarting: it will be back (the deadline bounds how long this waits for it).
    if (!snapshot.ok() && !absl::IsUnavailable(snapshot.status())) return snapshot.status();
    std::lock_guard<std::mutex> lock(state_->mutex);
    // Taken now: the rank's latest taken step is no longer the one before this try (none when that
    // was `step`, lost with its daemon).
    const bool took = last_taken == step ? state_->last_taken.has_value()
                                         : state_->last_taken != last_taken;
    if (!snapshot.ok() || !took) {
      // Skipped again with nothing of the rank in flight: the pool is short of room until the
      // cluster commits (or an operator frees some), or the daemon is not back yet. Ask again
      // a little later.
      std::this_thread::sleep_for(retry_pause);
      retry_pause = std::min(retry_pause * 2, std::chrono::milliseconds(1000));
    }
  }
}

absl::Status Client::WaitCommitted(int64_t step) { return Wait(step, true); }

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
  request.set_rank(state_->options.rank);
  for (const std::string& region : regions) request.add_regions(region);
  return state_->WithReconnect([&]() -> absl::StatusOr<RestoreResult> {
    grpc::ClientContext context;
    state_->PrepareCall(context, state_->options.wait_timeout);
    v1::RestoreResponse response;
    if (absl::Status status =
            state_->Check(state_->stub->Restore(&context, request, &response), "Restore");
        !status.ok()) {
      return status;
    }
    RestoreResult result;
    result.step = response.step();
    absl::StatusOr<std::vector<RestoredRegionView>> restored = ReadRestored(response);
    if (!restored.ok()) return restored.status();
    result.regions.reserve(restored->size());
    for (const RestoredRegionView& region : *restored) {
      result.regions.push_back({std::string(region.name), region.step, region.bytes});
    }
    result.tier =
        response.tier() == v1::TIER_DURABLE ? RestoreTier::kDurable : RestoreTier::kMemory;
    if (response.has_source_node()) result.source_node = response.source_node();
    result.decoded = response.decoded();
    return result;
  });
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
  v1::AppendLogRequest request;
  v1::LogRecord* record = request.mutable_record();
  record->set_rank(state_->options.rank);
  record->set_step(step);
  record->set_micro_batch(micro_batch);
  record->set_direction(ToWire(direction));
  record->set_peer_rank(peer_rank);
  record->set_payload(std::string(payload));
  return state_->WithReconnect([&] {
    grpc::ClientContext context;
    state_->PrepareCall(context, state_->options.call_timeout);
    v1::AppendLogResponse response;
    return state_->Check(state_->stub->AppendLog(&context, request, &response), "AppendLog");
  });
}

absl::StatusOr<std::vector<LoggedMessage>> Client::FetchLog(uint32_t sender_rank, int64_t step,
                                                            LogDirection direction,
                                                            uint32_t peer_rank) {
  v1::FetchLogRequest request;
  request.set_rank(sender_rank);
  request.set_step(step);
  request.set_direction(ToWire(direction));
  request.set_peer_rank(peer_rank);
  v1::FetchLogResponse response;
  absl::Status fetched = state_->WithReconnect([&] {
    grpc::ClientContext context;
    state_->PrepareCall(context, state_->options.wait_timeout);
    return state_->Check(state_->stub->FetchLog(&context, request, &response), "FetchLog");
  });
  if (!fetched.ok()) return fetched;
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
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->ReconnectLocked();
}

std::vector<std::pair<int64_t, std::string>> Client::TakeSkippedSteps() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return std::exchange(state_->skipped_steps, {});
}

uint32_t Client::rank() const { return state_->options.rank; }

uint32_t Client::node_id() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->hello.node_id();
}

}  // namespace moesnap
