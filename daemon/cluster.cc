// Cluster: membership, the coordinator's rounds, the participant's phases, parity over the data
// plane, and rebuild/repair by decoding k surviving units per stripe.
#include "daemon/cluster.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "daemon/data_plane.h"
#include "daemon/parity_store.h"
#include "erasure/crc32c.h"
#include "erasure/reed_solomon.h"
#include "erasure/stripe_layout.h"
#include "proto/moesnap.grpc.pb.h"

namespace moesnap::daemon {
namespace {

constexpr int kDataConnectionsPerPeer = 2;
constexpr uint32_t kMaxFramePayload = 4 << 20;
// Stripes rebuilt together are bounded by the bytes their units take in memory.
constexpr uint64_t kRebuildBatchBytes = uint64_t{64} << 20;
constexpr absl::Duration kControlDeadline = absl::Seconds(10);
constexpr int kRebuildAttempts = 3;
// How long fetched units or regions may take to arrive once their senders have answered.
constexpr absl::Duration kFetchWait = absl::Seconds(30);

std::shared_ptr<grpc::ChannelCredentials> PeerChannelCredentials() {
  return grpc::InsecureChannelCredentials();
}
std::shared_ptr<grpc::ServerCredentials> PeerServerCredentials() {
  return grpc::InsecureServerCredentials();
}

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

std::chrono::system_clock::time_point Deadline(absl::Duration timeout) {
  return absl::ToChronoTime(absl::Now() + timeout);
}

// Runs `call` for every item on its own thread and returns the statuses in order.
template <typename Item, typename Call>
std::vector<absl::Status> InParallel(const std::vector<Item>& items, Call call) {
  std::vector<absl::Status> statuses(items.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < items.size(); ++i) {
    threads.emplace_back([&, i] { statuses[i] = call(items[i]); });
  }
  for (std::thread& thread : threads) thread.join();
  return statuses;
}

}  // namespace

class Cluster::Impl final : public v1::Peer::Service, public FrameSink {
 public:
  Impl(uint32_t node_id, const ClusterOptions& options, Pool* pool, Store* store,
       UpstreamLog* log, const durable::DurableDirectory* durable, erasure::StripeLayout layout,
       std::unique_ptr<erasure::ReedSolomon> codec)
      : node_id_(node_id), options_(options), pool_(pool), store_(store), log_(log),
        durable_(durable),
        layout_(std::move(layout)), codec_(std::move(codec)),
        group_(options.GroupOf(node_id)->first), position_(options.GroupOf(node_id)->second),
        groups_(options.Groups()),
        parity_(pool, codec_.get(), &layout_, position_,
                absl::Milliseconds(options.commit_timeout_ms)),
        heartbeat_interval_(std::max(absl::Milliseconds(options.heartbeat_timeout_ms) / 5,
                                     absl::Milliseconds(20))),
        digest_(options.Digest()) {}

  ~Impl() override;
  absl::Status Start();

  v1::ClusterStatusResponse Status() const;
  absl::StatusOr<v1::RebuildResponse> RebuildNode(uint32_t node_id);
  void set_crash_in_commit(int64_t step) { crash_in_commit_ = step; }
  absl::StatusOr<v1::VerifyResponse> Verify(std::optional<int64_t> step, bool repair);
  absl::StatusOr<v1::RestoreResponse> RestoreFrom(uint32_t rank, uint32_t source_rank,
                                                  const std::vector<std::string>& regions);
  absl::StatusOr<v1::FetchLogResponse> FetchRemoteLog(const v1::FetchLogRequest& request);
  absl::Status WaitMemory(absl::Time deadline);
  durable::PeerSurvey SurveyPeers(absl::Time deadline);

  // v1::Peer::Service
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse*) override;
  grpc::Status Propose(grpc::ServerContext*, const v1::ProposeRequest*, v1::ProposeResponse*) override;
  grpc::Status Prepare(grpc::ServerContext*, const v1::PrepareRequest*, v1::PrepareResponse*) override;
  grpc::Status Encode(grpc::ServerContext*, const v1::EncodeRequest*, v1::EncodeResponse*) override;
  grpc::Status Commit(grpc::ServerContext*, const v1::CommitRequest*, v1::CommitResponse*) override;
  grpc::Status Abort(grpc::ServerContext*, const v1::AbortRequest*, v1::AbortResponse*) override;
  grpc::Status StepOutcome(grpc::ServerContext*, const v1::StepOutcomeRequest*,
                           v1::StepOutcomeResponse*) override;
  grpc::Status GroupState(grpc::ServerContext*, const v1::GroupStateRequest*,
                          v1::GroupStateResponse*) override;
  grpc::Status SendUnits(grpc::ServerContext*, const v1::SendUnitsRequest*,
                         v1::SendUnitsResponse*) override;
  grpc::Status Rebuild(grpc::ServerContext*, const v1::PeerRebuildRequest*,
                       v1::RebuildResponse*) override;
  grpc::Status LocateRank(grpc::ServerContext*, const v1::LocateRankRequest*,
                          v1::LocateRankResponse*) override;
  grpc::Status SendRegion(grpc::ServerContext*, const v1::SendRegionRequest*,
                          v1::SendRegionResponse*) override;
  grpc::Status FetchLog(grpc::ServerContext*, const v1::FetchLogRequest*,
                        v1::FetchLogResponse*) override;
  grpc::Status DurableState(grpc::ServerContext*, const v1::DurableStateRequest*,
                            v1::DurableStateResponse*) override;

  // FrameSink
  absl::Status Accept(const FrameHeader& header, absl::Span<const uint8_t> payload) override;

 private:
  struct PeerState {
    ClusterNode node;
    std::unique_ptr<v1::Peer::Stub> stub;
    absl::Time last_seen = absl::InfinitePast();
    v1::HeartbeatResponse last;
    std::string refused;  // why it refused our config, if it did
  };
  struct OpenStep {
    uint32_t coordinator = 0;
    NodeImage image;
    std::vector<v1::NodeImage> group_images;
    bool encoded = false;
  };
  // What a rebuild decodes and where it puts it: the units of node `position` of group `group`.
  struct RebuildTarget {
    v1::JournalCluster record;  // the group's record of the step being rebuilt
    int group = 0;
    int position = 0;
    // Receives each decoded data unit (its index in the node's image, its bytes).
    std::function<void(uint64_t unit, const uint8_t* bytes, uint64_t length)> write_data;
    std::map<uint64_t, ParityUnit>* parity = nullptr;  // decoded parity goes here (null: none)
  };
  struct FetchSlot {
    uint8_t* buffer = nullptr;
    uint64_t bytes = 0;
    uint64_t missing = 0;
  };
  // What a fetch waits for: unit `unit` of stripe `stripe` (kFetchedUnit frames; rank 0, no
  // region), or region `region` of rank `rank` (kFetchedRegion frames; stripe and unit 0).
  struct FetchKey {
    int64_t step = 0;
    uint64_t stripe = 0;
    uint32_t unit = 0;
    uint32_t rank = 0;
    std::string region;
    bool operator<(const FetchKey& other) const {
      return std::tie(step, stripe, unit, rank, region) <
             std::tie(other.step, other.stripe, other.unit, other.rank, other.region);
    }
    std::string Describe() const {
      return region.empty() ? absl::StrCat("unit ", unit, " of stripe ", stripe, ", step ", step)
                            : absl::StrCat("region '", region, "' of rank ", rank, ", step ", step);
    }
  };

  bool LiveLocked(uint32_t id) const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  uint32_t CoordinatorLocked() const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  bool Live(uint32_t id) const;
  uint32_t Coordinator() const;
  v1::Peer::Stub* Stub(uint32_t id) const;
  absl::StatusOr<std::shared_ptr<DataPlaneClient>> DataClient(uint32_t id);
  // Forgets the connections to a lost peer; the next send reconnects.
  void DropDataClient(uint32_t id);
  std::optional<int64_t> CommittedStep() const;
  v1::NodeMemory Memory() const;
  absl::Status CheckCoordinator(uint32_t coordinator) const;
  uint32_t NodeAt(int group, int position) const { return groups_[group][position]; }
  uint32_t NodeAt(int position) const { return NodeAt(group_, position); }

  void HeartbeatLoop(uint32_t peer);
  void ProposeLoop();
  void CoordinatorLoop();
  void RunRound(int64_t step);
  void ResolveOrphans();
  absl::Status SendCommit(uint32_t id, int64_t step);
  absl::Status SendAbort(uint32_t id, int64_t step, const std::string& reason);
  void OnNodeCaptured(int64_t step);

  // Sends this node's data units of `step` to their parity holders: all of them, or with
  // `previous` (the committed image) and `changed`, the deltas of the changed ones. Returns the
  // bytes sent.
  absl::StatusOr<uint64_t> SendDataUnits(int64_t step, const NodeImage& image,
                                         const std::optional<NodeImage>& previous,
                                         const std::vector<bool>* changed);
  absl::Status SendFrames(uint32_t to, FrameHeader header, const uint8_t* bytes, uint64_t length);

  void RebuildAtStart();
  // False when the cluster is stopping.
  bool SleepUnlessStopping(absl::Duration duration);
  absl::StatusOr<v1::RebuildResponse> RebuildSelf(bool force);
  // Decodes this node's units of `stripes` from k units of the group's other nodes.
  absl::Status RebuildStripes(const RebuildTarget& target, const std::vector<uint64_t>& stripes,
                              v1::RebuildResponse* stats);
  // Which positions of `group` hold `step` whole now (live, not rebuilding, committed it); the
  // position being rebuilt never counts.
  std::vector<bool> HoldersOf(int group, int64_t step, int excluded_position);
  // Expects the frames of `keys` into their buffers (registered before the request that sends
  // them goes out).
  void ExpectFetches(const std::vector<std::pair<FetchKey, FetchSlot>>& slots);
  // After the sending requests returned `sent`: waits until every expected byte arrived (when they
  // succeeded) and forgets the keys either way.
  absl::Status CollectFetches(const std::vector<FetchKey>& keys, absl::Status sent);

  const uint32_t node_id_;
  const ClusterOptions options_;
  Pool* const pool_;
  Store* const store_;
  UpstreamLog* const log_;
  const durable::DurableDirectory* const durable_;
  const erasure::StripeLayout layout_;
  const std::unique_ptr<erasure::ReedSolomon> codec_;
  const int group_;
  const int position_;
  const std::vector<std::vector<uint32_t>> groups_;
  ParityStore parity_;
  const absl::Duration heartbeat_interval_;
  const uint64_t digest_;  // of options_, sent with every heartbeat

  std::atomic<int64_t> crash_in_commit_{-1};
  std::atomic<uint64_t> full_encodes_{0};
  std::atomic<uint64_t> delta_encodes_{0};
  std::atomic<uint64_t> parity_bytes_sent_{0};
  std::unique_ptr<DataPlaneServer> data_server_;
  std::unique_ptr<grpc::Server> server_;

  mutable absl::Mutex mutex_;
  absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::map<uint32_t, PeerState> peers_ ABSL_GUARDED_BY(mutex_);
  std::map<int64_t, OpenStep> open_ ABSL_GUARDED_BY(mutex_);
  bool rebuilding_ ABSL_GUARDED_BY(mutex_) = true;  // until the start-up check says otherwise
  absl::Status rebuild_error_ ABSL_GUARDED_BY(mutex_);
  std::deque<int64_t> to_propose_ ABSL_GUARDED_BY(mutex_);
  std::set<int64_t> proposed_ ABSL_GUARDED_BY(mutex_);  // coordinator: steps awaiting a round
  std::optional<int64_t> last_round_ ABSL_GUARDED_BY(mutex_);
  std::optional<int64_t> running_round_ ABSL_GUARDED_BY(mutex_);
  std::string last_abort_ ABSL_GUARDED_BY(mutex_);
  std::set<int64_t> resolved_orphans_ ABSL_GUARDED_BY(mutex_);

  absl::Mutex data_mutex_;
  std::map<uint32_t, std::shared_ptr<DataPlaneClient>> data_clients_ ABSL_GUARDED_BY(data_mutex_);

  absl::Mutex fetch_mutex_;
  absl::CondVar fetched_;
  std::map<FetchKey, FetchSlot> fetches_ ABSL_GUARDED_BY(fetch_mutex_);

  absl::Mutex rebuild_mutex_;  // one rebuild or repair at a time
  std::vector<std::thread> threads_;
};

// --- Start and stop ----------------------------------------------------------------------------

absl::Status Cluster::Impl::Start() {
  if (absl::Status status = parity_.Recover(store_->ClusterRecord()); !status.ok()) return status;
  {
    absl::MutexLock lock(&mutex_);
    for (const ClusterNode& node : options_.nodes) {
      PeerState& peer = peers_[node.id];
      peer.node = node;
      // Reconnect within a heartbeat: a restarted peer must be seen as soon as it answers.
      grpc::ChannelArguments arguments;
      const int backoff_ms = static_cast<int>(absl::ToInt64Milliseconds(heartbeat_interval_));
      arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, backoff_ms);
      arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, backoff_ms);
      arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, backoff_ms);
      arguments.SetMaxReceiveMessageSize(64 << 20);
      peer.stub = v1::Peer::NewStub(grpc::CreateCustomChannel(
          absl::StrCat(node.host, ":", node.control_port), PeerChannelCredentials(), arguments));
    }
  }
  const ClusterNode& self = peers_[node_id_].node;
  absl::StatusOr<std::unique_ptr<DataPlaneServer>> data_server =
      DataPlaneServer::Start({self.host, self.data_port, kMaxFramePayload}, this);
  if (!data_server.ok()) return data_server.status();
  data_server_ = *std::move(data_server);

  grpc::ServerBuilder builder;
  int bound_port = 0;
  builder.AddListeningPort(absl::StrCat(self.host, ":", self.control_port), PeerServerCredentials(),
                           &bound_port);
  builder.RegisterService(this);
  builder.SetMaxReceiveMessageSize(64 << 20);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || bound_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve the Peer service on ", self.host, ":",
                                               self.control_port, " (is the port in use?)"));
  }

  // The config check: every peer that answers now must agree, or this daemon does not join.
  v1::HeartbeatRequest hello;
  hello.set_from_node(node_id_);
  hello.set_cluster_digest(digest_);
  *hello.mutable_cluster() = ShapeOf(options_);
  for (const ClusterNode& node : options_.nodes) {
    if (node.id == node_id_) continue;
    grpc::ClientContext context;
    context.set_deadline(Deadline(absl::Seconds(1)));
    v1::HeartbeatResponse response;
    const grpc::Status status = Stub(node.id)->Heartbeat(&context, hello, &response);
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      return absl::FailedPreconditionError(absl::StrCat("node ", node.id, " refuses to join: ",
                                                        status.error_message()));
    }
    if (status.ok()) {
      absl::MutexLock lock(&mutex_);
      peers_[node.id].last_seen = absl::Now();
      peers_[node.id].last = response;
    }
  }

  store_->SetNodeCapturedCallback([this](int64_t step) { OnNodeCaptured(step); });
  store_->SetRestoreGate([this](absl::Time deadline) { return WaitMemory(deadline); });
  for (const ClusterNode& node : options_.nodes) {
    if (node.id != node_id_) threads_.emplace_back([this, id = node.id] { HeartbeatLoop(id); });
  }
  threads_.emplace_back([this] { ProposeLoop(); });
  threads_.emplace_back([this] { CoordinatorLoop(); });
  threads_.emplace_back([this] { RebuildAtStart(); });
  Log(LogLevel::kInfo, "node ", node_id_, " is position ", position_, " of group ", group_, " [",
      absl::StrJoin(groups_[group_], ", "), "], k=", options_.data_units, " m=", options_.parity_units,
      "; peers on ", self.host, ":", self.control_port, ", data plane on port ", self.data_port);
  return absl::OkStatus();
}

Cluster::Impl::~Impl() {
  store_->SetNodeCapturedCallback(nullptr);
  store_->SetRestoreGate(nullptr);
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    changed_.SignalAll();
  }
  if (server_) server_->Shutdown(Deadline(absl::Seconds(1)));
  for (std::thread& thread : threads_) thread.join();
  data_server_.reset();
}

absl::Status Cluster::Impl::WaitMemory(absl::Time deadline) {
  absl::MutexLock lock(&mutex_);
  while (rebuilding_) {
    if (changed_.WaitWithDeadline(&mutex_, deadline)) {
      return absl::UnavailableError(absl::StrCat(
          "node ", node_id_, " is still rebuilding its data from group ", group_, "; retry"));
    }
  }
  return rebuild_error_;
}

// --- Durable tier --------------------------------------------------------------------------------

grpc::Status Cluster::Impl::DurableState(grpc::ServerContext*, const v1::DurableStateRequest*,
                                         v1::DurableStateResponse* response) {
  response->set_node_id(node_id_);
  if (durable_ != nullptr) {
    absl::StatusOr<std::vector<int64_t>> steps = durable_->Steps();
    if (!steps.ok()) return ToGrpcStatus(steps.status());
    for (int64_t step : *steps) response->add_durable_steps(step);
  }
  const std::optional<int64_t> committed = CommittedStep();
  absl::MutexLock lock(&mutex_);
  response->set_settled(!rebuilding_);
  if (!rebuilding_ && rebuild_error_.ok() && committed) response->set_memory_step(*committed);
  return grpc::Status::OK;
}

durable::PeerSurvey Cluster::Impl::SurveyPeers(absl::Time deadline) {
  std::vector<uint32_t> peers;
  for (const ClusterNode& node : options_.nodes) {
    if (node.id != node_id_) peers.push_back(node.id);
  }
  std::vector<size_t> indices(peers.size());
  std::iota(indices.begin(), indices.end(), 0);
  std::vector<v1::DurableStateResponse> answers(peers.size());
  const std::vector<absl::Status> statuses = InParallel(indices, [&](size_t i) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    return FromGrpcStatus(Stub(peers[i])->DurableState(&context, {}, &answers[i]));
  });
  durable::PeerSurvey survey;
  for (size_t i = 0; i < peers.size(); ++i) {
    if (!statuses[i].ok()) {
      survey.silent[peers[i]] = std::string(statuses[i].message());
      continue;
    }
    durable::NodeDurability& node = survey.answered.emplace_back();
    node.node_id = peers[i];
    node.durable_steps.assign(answers[i].durable_steps().begin(), answers[i].durable_steps().end());
    if (answers[i].has_memory_step()) node.memory_step = answers[i].memory_step();
    node.settled = answers[i].settled();
  }
  return survey;
}

// --- Membership ----------------------------------------------------------------------------------

bool Cluster::Impl::LiveLocked(uint32_t id) const {
  if (id == node_id_) return true;
  auto it = peers_.find(id);
  return it != peers_.end() && it->second.refused.empty() &&
         absl::Now() - it->second.last_seen < absl::Milliseconds(options_.heartbeat_timeout_ms);
}

uint32_t Cluster::Impl::CoordinatorLocked() const {
  for (const auto& [id, peer] : peers_) {
    if (LiveLocked(id)) return id;
  }
  return node_id_;
}

bool Cluster::Impl::Live(uint32_t id) const {
  absl::MutexLock lock(&mutex_);
  return LiveLocked(id);
}

uint32_t Cluster::Impl::Coordinator() const {
  absl::MutexLock lock(&mutex_);
  return CoordinatorLocked();
}

v1::Peer::Stub* Cluster::Impl::Stub(uint32_t id) const {
  absl::MutexLock lock(&mutex_);
  return peers_.at(id).stub.get();
}

absl::StatusOr<std::shared_ptr<DataPlaneClient>> Cluster::Impl::DataClient(uint32_t id) {
  {
    absl::MutexLock lock(&data_mutex_);
    if (auto it = data_clients_.find(id); it != data_clients_.end()) return it->second;
  }
  // Connect outside the lock, so a slow peer delays only the callers that send to it.
  const ClusterNode* node = nullptr;
  for (const ClusterNode& candidate : options_.nodes) {
    if (candidate.id == id) node = &candidate;
  }
  if (node == nullptr) return absl::NotFoundError(absl::StrCat("node ", id, " is not in the cluster"));
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> connected =
      DataPlaneClient::Connect(node->host, node->data_port, kDataConnectionsPerPeer);
  if (!connected.ok()) {
    return absl::UnavailableError(absl::StrCat("data plane of node ", id, ": ",
                                               connected.status().message()));
  }
  Log(LogLevel::kDebug, "data plane: connected to node ", id);
  absl::MutexLock lock(&data_mutex_);
  // Another sender may have connected meanwhile: one client per peer, the first one kept.
  auto [it, inserted] = data_clients_.try_emplace(id, *std::move(connected));
  return it->second;
}

void Cluster::Impl::DropDataClient(uint32_t id) {
  absl::MutexLock lock(&data_mutex_);
  if (data_clients_.erase(id) > 0) Log(LogLevel::kDebug, "data plane: dropped node ", id);
}

std::optional<int64_t> Cluster::Impl::CommittedStep() const {
  const v1::JournalCluster record = store_->ClusterRecord();
  if (!record.has_committed_step()) return std::nullopt;
  return record.committed_step();
}

v1::NodeMemory Cluster::Impl::Memory() const {
  v1::NodeMemory memory;
  memory.set_data_bytes(store_->CommittedBytes());
  memory.set_parity_bytes(parity_.committed_bytes());
  memory.set_in_flight_bytes(store_->Status().pool_in_flight_bytes() + parity_.in_flight_bytes());
  memory.set_pool_bytes(pool_->capacity());
  return memory;
}

absl::Status Cluster::Impl::CheckCoordinator(uint32_t coordinator) const {
  absl::MutexLock lock(&mutex_);
  for (const auto& [id, peer] : peers_) {
    if (id >= coordinator) break;
    if (LiveLocked(id)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node ", coordinator, " is not the coordinator: node ", id, " is live and lower"));
    }
  }
  return absl::OkStatus();
}

void Cluster::Impl::HeartbeatLoop(uint32_t peer_id) {
  v1::HeartbeatRequest request;
  request.set_from_node(node_id_);
  request.set_cluster_digest(digest_);
  v1::Peer::Stub* stub = Stub(peer_id);
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(Deadline(heartbeat_interval_ * 2));
    v1::HeartbeatResponse response;
    const grpc::Status status = stub->Heartbeat(&context, request, &response);
    bool lost = false;
    {
      absl::MutexLock lock(&mutex_);
      PeerState& peer = peers_[peer_id];
      const bool was_live = LiveLocked(peer_id);
      if (status.ok()) {
        peer.last_seen = absl::Now();
        peer.last = response;
        peer.refused.clear();
      } else if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
        if (peer.refused.empty()) {
          Log(LogLevel::kError, "node ", peer_id, " refuses this node: ", status.error_message());
        }
        peer.refused = status.error_message();
      }
      const bool live = LiveLocked(peer_id);
      lost = was_live && !live;
      if (was_live != live) {
        Log(live ? LogLevel::kInfo : LogLevel::kWarning, "node ", peer_id,
            live ? " is live" : " is lost: no heartbeat answered for ",
            live ? "" : absl::StrCat(options_.heartbeat_timeout_ms, " ms"));
        changed_.SignalAll();
      }
    }
    if (lost) DropDataClient(peer_id);  // outside mutex_: never wait on the data plane under it
    if (!SleepUnlessStopping(heartbeat_interval_)) return;
  }
}

grpc::Status Cluster::Impl::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) {
  if (request->has_cluster()) {
    const std::string difference = options_.DifferenceFrom(OptionsOf(request->cluster()));
    if (!difference.empty()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("node ", request->from_node(), " has another cluster config "
                                       "than node ", node_id_, ": ", difference));
    }
  } else if (request->cluster_digest() != digest_) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("node ", request->from_node(), " has another cluster config "
                                     "than node ", node_id_, " (its digest differs; restarting it "
                                     "names the difference)"));
  }
  response->set_node_id(node_id_);
  if (std::optional<int64_t> step = CommittedStep()) response->set_latest_committed_step(*step);
  *response->mutable_memory() = Memory();
  absl::MutexLock lock(&mutex_);
  response->set_rebuilding(rebuilding_ || !rebuild_error_.ok());
  if (!open_.empty()) {
    response->set_open_step(open_.rbegin()->first);
    response->set_open_step_coordinator(open_.rbegin()->second.coordinator);
  }
  return grpc::Status::OK;
}

// --- Coordinator ---------------------------------------------------------------------------------

void Cluster::Impl::OnNodeCaptured(int64_t step) {
  absl::MutexLock lock(&mutex_);
  to_propose_.push_back(step);
  changed_.SignalAll();
}

void Cluster::Impl::ProposeLoop() {
  while (true) {
    int64_t step = 0;
    {
      absl::MutexLock lock(&mutex_);
      while (to_propose_.empty() && !stopping_) changed_.Wait(&mutex_);
      if (stopping_) return;
      step = to_propose_.front();
      to_propose_.pop_front();
    }
    // Retried while the coordinator changes or is unreachable; the commit timeout bounds it.
    const absl::Time give_up = absl::Now() + absl::Milliseconds(options_.commit_timeout_ms);
    while (absl::Now() < give_up) {
      v1::ProposeRequest request;
      request.set_from_node(node_id_);
      request.set_step(step);
      grpc::ClientContext context;
      context.set_deadline(Deadline(kControlDeadline));
      v1::ProposeResponse response;
      if (Stub(Coordinator())->Propose(&context, request, &response).ok()) {
        if (response.decided()) {
          // Captured after the cluster's round of the step ended (a replacement replaying it, or
          // a capture slower than the commit timeout): no round will take it, so end it here.
          store_->AbortNodeStep(step, absl::AbortedError(absl::StrCat(
                                          "the cluster decided step ", step,
                                          " before this node captured it")));
        }
        break;
      }
      absl::MutexLock lock(&mutex_);
      changed_.WaitWithTimeout(&mutex_, heartbeat_interval_);
      if (stopping_) return;
    }
  }
}

grpc::Status Cluster::Impl::Propose(grpc::ServerContext*, const v1::ProposeRequest* request,
                                    v1::ProposeResponse* response) {
  absl::MutexLock lock(&mutex_);
  const uint32_t coordinator = CoordinatorLocked();
  if (coordinator != node_id_) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("node ", coordinator, " is the coordinator"));
  }
  if (!last_round_ || request->step() > *last_round_) {
    proposed_.insert(request->step());
  } else if (request->step() != running_round_) {
    response->set_decided(true);
  }
  changed_.SignalAll();
  return grpc::Status::OK;
}

void Cluster::Impl::CoordinatorLoop() {
  while (true) {
    std::optional<int64_t> step;
    {
      absl::MutexLock lock(&mutex_);
      if (stopping_) return;
      if (proposed_.empty()) changed_.WaitWithTimeout(&mutex_, heartbeat_interval_);
      if (stopping_) return;
      if (CoordinatorLocked() == node_id_ && !proposed_.empty()) {
        step = *proposed_.begin();
        proposed_.erase(proposed_.begin());
        last_round_ = step;
        running_round_ = step;
      }
    }
    if (Coordinator() == node_id_) ResolveOrphans();
    if (step) RunRound(*step);
    absl::MutexLock lock(&mutex_);
    running_round_.reset();
  }
}

void Cluster::Impl::RunRound(int64_t step) {
  std::vector<uint32_t> nodes;
  for (const ClusterNode& node : options_.nodes) nodes.push_back(node.id);
  const absl::Time started = absl::Now();
  auto abort = [&](const std::string& reason) {
    Log(LogLevel::kWarning, "step ", step, " aborted: ", reason);
    {
      absl::MutexLock lock(&mutex_);
      last_abort_ = absl::StrCat("step ", step, ": ", reason);
    }
    InParallel(nodes, [&](uint32_t id) { return SendAbort(id, step, reason); });
  };
  for (uint32_t id : nodes) {
    if (!Live(id)) {
      abort(absl::StrCat("node ", id, " of group ", options_.GroupOf(id)->first,
                         " is lost; snapshots need every node of every group (rebuild it with a "
                         "replacement daemon started with its id)"));
      return;
    }
  }

  Log(LogLevel::kDebug, "step ", step, ": prepare");
  // Phase 1a: every node captured the step.
  std::map<uint32_t, v1::NodeImage> images;
  absl::Mutex images_mutex;
  std::vector<absl::Status> prepared = InParallel(nodes, [&](uint32_t id) -> absl::Status {
    v1::PrepareRequest request;
    request.set_coordinator(node_id_);
    request.set_step(step);
    request.set_timeout_ms(options_.commit_timeout_ms);
    grpc::ClientContext context;
    context.set_deadline(Deadline(absl::Milliseconds(options_.commit_timeout_ms) + kControlDeadline));
    v1::PrepareResponse response;
    const grpc::Status status = Stub(id)->Prepare(&context, request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    absl::MutexLock lock(&images_mutex);
    images[id] = response.image();
    return absl::OkStatus();
  });
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (!prepared[i].ok()) {
      abort(absl::StrCat("node ", nodes[i], " did not prepare: ", prepared[i].message()));
      return;
    }
  }

  Log(LogLevel::kDebug, "step ", step, ": encode");
  // Phase 1b: parity of every group delivered and stored.
  const std::vector<std::vector<uint32_t>> groups = options_.Groups();
  std::atomic<uint64_t> sent{0};
  std::atomic<bool> delta{true};
  std::vector<absl::Status> encoded = InParallel(nodes, [&](uint32_t id) -> absl::Status {
    v1::EncodeRequest request;
    request.set_coordinator(node_id_);
    request.set_step(step);
    request.set_timeout_ms(options_.commit_timeout_ms);
    for (uint32_t member : groups[options_.GroupOf(id)->first]) {
      *request.add_group_images() = images[member];
    }
    grpc::ClientContext context;
    context.set_deadline(Deadline(absl::Milliseconds(options_.commit_timeout_ms) + kControlDeadline));
    v1::EncodeResponse response;
    const grpc::Status status = Stub(id)->Encode(&context, request, &response);
    sent += response.bytes_sent();
    if (!response.delta()) delta = false;
    return FromGrpcStatus(status);
  });
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (!encoded[i].ok()) {
      abort(absl::StrCat("node ", nodes[i], " did not store its parity: ", encoded[i].message()));
      return;
    }
  }

  Log(LogLevel::kDebug, "step ", step, ": commit");
  // Phase 2. Past this point the step is decided: a node that misses the commit learns it from
  // its group when it comes back (rebuild), or from the next coordinator.
  auto commit = [&](uint32_t id) { return SendCommit(id, step); };
  if (crash_in_commit_ >= 0 && step >= crash_in_commit_) {
    for (size_t i = 0; i < nodes.size() / 2; ++i) (void)commit(nodes[i]);
    Log(LogLevel::kWarning, "fault injection: SIGKILL after committing step ", step, " on ",
        nodes.size() / 2, " of ", nodes.size(), " nodes");
    raise(SIGKILL);
  }
  std::vector<absl::Status> committed = InParallel(nodes, commit);
  uint64_t bytes = 0;
  for (const auto& [id, image] : images) bytes += image.bytes();
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (!committed[i].ok()) {
      Log(LogLevel::kWarning, "step ", step, ": node ", nodes[i],
          " did not confirm the commit: ", committed[i].message());
    }
  }
  Log(LogLevel::kInfo, "step ", step, " committed on ", nodes.size(), " nodes (", bytes,
      " bytes of data, ", sent.load(), delta ? " bytes of deltas" : " bytes of units",
      " sent to parity holders) in ", absl::FormatDuration(absl::Now() - started));
}

absl::Status Cluster::Impl::SendCommit(uint32_t id, int64_t step) {
  v1::CommitRequest request;
  request.set_coordinator(node_id_);
  request.set_step(step);
  grpc::ClientContext context;
  context.set_deadline(Deadline(kControlDeadline));
  v1::CommitResponse response;
  return FromGrpcStatus(Stub(id)->Commit(&context, request, &response));
}

absl::Status Cluster::Impl::SendAbort(uint32_t id, int64_t step, const std::string& reason) {
  v1::AbortRequest request;
  request.set_coordinator(node_id_);
  request.set_step(step);
  request.set_reason(reason);
  grpc::ClientContext context;
  context.set_deadline(Deadline(kControlDeadline));
  v1::AbortResponse response;
  return FromGrpcStatus(Stub(id)->Abort(&context, request, &response));
}

void Cluster::Impl::ResolveOrphans() {
  // Open steps whose coordinator is gone: finish them from what the nodes report.
  std::set<int64_t> orphans;
  {
    absl::MutexLock lock(&mutex_);
    for (const auto& [id, peer] : peers_) {
      if (id == node_id_ || !LiveLocked(id) || !peer.last.has_open_step()) continue;
      const uint32_t owner = peer.last.open_step_coordinator();
      if (owner != node_id_ && !LiveLocked(owner)) orphans.insert(peer.last.open_step());
    }
    for (const auto& [step, open] : open_) {
      if (open.coordinator != node_id_ && !LiveLocked(open.coordinator)) orphans.insert(step);
    }
    // Heartbeats report an open step until the next one after its resolution.
    for (int64_t step : resolved_orphans_) orphans.erase(step);
  }
  std::vector<uint32_t> nodes;
  for (const ClusterNode& node : options_.nodes) {
    if (Live(node.id)) nodes.push_back(node.id);
  }
  for (int64_t step : orphans) {
    // The old coordinator committed only after every node encoded the step. So: a node committed,
    // or every live node encoded it (the old coordinator may have begun committing) -> commit,
    // which is always safe then; a live node that never encoded it -> no commit can have happened
    // anywhere -> abort.
    std::atomic<bool> any_committed{false};
    std::atomic<bool> all_encoded{true};
    InParallel(nodes, [&](uint32_t id) -> absl::Status {
      v1::StepOutcomeRequest request;
      request.set_step(step);
      grpc::ClientContext context;
      context.set_deadline(Deadline(kControlDeadline));
      v1::StepOutcomeResponse response;
      const grpc::Status status = Stub(id)->StepOutcome(&context, request, &response);
      if (status.ok() && response.state() == v1::STEP_STATE_COMMITTED) any_committed = true;
      if (!status.ok() || (response.state() != v1::STEP_STATE_COMMITTED &&
                           response.state() != v1::STEP_STATE_ENCODED)) {
        all_encoded = false;
      }
      return FromGrpcStatus(status);
    });
    const bool commit = any_committed || all_encoded;
    Log(LogLevel::kWarning, "step ", step, " was left open by a lost coordinator: ",
        any_committed  ? "committing it (a node had committed)"
        : all_encoded ? "committing it (every live node had encoded it)"
                      : "aborting it (a live node had not encoded it, so none committed)");
    std::vector<absl::Status> statuses = InParallel(nodes, [&](uint32_t id) {
      return commit ? SendCommit(id, step)
                    : SendAbort(id, step, "its coordinator was lost before every node encoded it");
    });
    // Until every live node took the decision, the next pass tries again.
    if (std::all_of(statuses.begin(), statuses.end(), [](const absl::Status& s) { return s.ok(); })) {
      absl::MutexLock lock(&mutex_);
      resolved_orphans_.insert(step);
    }
  }
}

// --- Participant ---------------------------------------------------------------------------------

grpc::Status Cluster::Impl::Prepare(grpc::ServerContext*, const v1::PrepareRequest* request,
                                    v1::PrepareResponse* response) {
  if (absl::Status status = CheckCoordinator(request->coordinator()); !status.ok()) {
    return ToGrpcStatus(status);
  }
  {
    absl::MutexLock lock(&mutex_);
    if (rebuilding_ || !rebuild_error_.ok()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("node ", node_id_, " does not hold its data of the latest "
                                       "committed step (rebuilding or unrecoverable)"));
    }
  }
  absl::StatusOr<NodeImage> image = store_->WaitNodeCaptured(
      request->step(), absl::Now() + absl::Milliseconds(request->timeout_ms()));
  if (!image.ok()) return ToGrpcStatus(image.status());
  *response->mutable_image() = image->manifest();
  response->mutable_image()->set_node_id(node_id_);
  absl::MutexLock lock(&mutex_);
  OpenStep& open = open_[request->step()];
  open.coordinator = request->coordinator();
  open.image = *std::move(image);
  return grpc::Status::OK;
}

grpc::Status Cluster::Impl::Encode(grpc::ServerContext*, const v1::EncodeRequest* request,
                                   v1::EncodeResponse* response) {
  const int64_t step = request->step();
  if (request->group_images_size() != layout_.group_size()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("step ", step, ": ", request->group_images_size(),
                                     " images for a group of ", layout_.group_size()));
  }
  NodeImage image;
  {
    absl::MutexLock lock(&mutex_);
    auto it = open_.find(step);
    if (it == open_.end() || it->second.coordinator != request->coordinator()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("step ", step, " was not prepared here by node ",
                                       request->coordinator()));
    }
    image = it->second.image;
  }
  std::vector<uint64_t> image_bytes;
  for (int position = 0; position < layout_.group_size(); ++position) {
    const v1::NodeImage& member = request->group_images(position);
    if (member.node_id() != NodeAt(position)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("step ", step, ": image ", position, " is node ",
                                       member.node_id(), "'s, not node ", NodeAt(position), "'s"));
    }
    image_bytes.push_back(member.bytes());
  }
  if (image_bytes[position_] != image.bytes()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "this node's image size differs");
  }
  // A step that keeps every node's layout updates the committed parity with the deltas of the
  // units it changed; anything else (the first step, a rank registering new regions) encodes whole.
  // Every node of the group decides the same from the same two records.
  const v1::JournalCluster committed = store_->ClusterRecord();
  bool delta = committed.has_committed_step() &&
               committed.group_images_size() == layout_.group_size();
  for (int position = 0; delta && position < layout_.group_size(); ++position) {
    delta = SameLayout(committed.group_images(position), request->group_images(position));
  }
  std::vector<std::vector<bool>> changed;
  if (delta) {
    for (int position = 0; position < layout_.group_size(); ++position) {
      changed.push_back(ChangedUnits(committed.group_images(position),
                                     request->group_images(position), layout_.unit_bytes()));
    }
  }
  if (absl::Status status = parity_.Begin(step, image_bytes, delta ? &changed : nullptr);
      !status.ok()) {
    return ToGrpcStatus(status);
  }
  const absl::Time deadline = absl::Now() + absl::Milliseconds(request->timeout_ms());
  absl::StatusOr<uint64_t> sent = SendDataUnits(
      step, image, delta ? std::optional<NodeImage>(store_->CommittedImage()) : std::nullopt,
      delta ? &changed[position_] : nullptr);
  absl::Status status = sent.status();
  if (status.ok()) status = parity_.WaitComplete(step, deadline);
  if (!status.ok()) {
    parity_.Abort(step);
    return ToGrpcStatus(status);
  }
  (delta ? delta_encodes_ : full_encodes_)++;
  parity_bytes_sent_ += *sent;
  response->set_bytes_sent(*sent);
  response->set_delta(delta);
  response->set_parity_bytes(parity_.in_flight_bytes());
  absl::MutexLock lock(&mutex_);
  OpenStep& open = open_[step];
  open.group_images.assign(request->group_images().begin(), request->group_images().end());
  open.encoded = true;
  return grpc::Status::OK;
}

absl::Status Cluster::Impl::SendFrames(uint32_t to, FrameHeader header, const uint8_t* bytes,
                                       uint64_t length) {
  absl::StatusOr<std::shared_ptr<DataPlaneClient>> client = DataClient(to);
  if (!client.ok()) return client.status();
  for (uint64_t offset = 0; offset < length; offset += kMaxFramePayload) {
    header.offset = offset;
    const uint64_t piece = std::min<uint64_t>(kMaxFramePayload, length - offset);
    if (absl::Status status = (*client)->Send(header, {bytes + offset, piece}); !status.ok()) {
      return absl::UnavailableError(absl::StrCat("sending stripe ", header.stripe, " to node ", to,
                                                 ": ", status.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Cluster::Impl::SendDataUnits(int64_t step, const NodeImage& image,
                                                      const std::optional<NodeImage>& previous,
                                                      const std::vector<bool>* changed) {
  // Each parity holder gets its units from its own thread, so holders fill in parallel.
  std::map<int, std::vector<uint64_t>> units_by_holder;
  const uint64_t units = layout_.UnitCount(image.bytes());
  for (uint64_t unit = 0; unit < units; ++unit) {
    if (changed != nullptr && !(*changed)[unit]) continue;
    const erasure::UnitLocation location = layout_.DataUnitLocation(position_, unit);
    for (int holder : layout_.Members(location.stripe).parity_positions) {
      units_by_holder[holder].push_back(unit);
    }
  }
  std::vector<int> holders;
  for (const auto& [holder, list] : units_by_holder) holders.push_back(holder);
  std::atomic<uint64_t> sent{0};
  std::vector<absl::Status> statuses = InParallel(holders, [&](int holder) -> absl::Status {
    std::vector<uint8_t> buffer(layout_.unit_bytes());
    std::vector<uint8_t> old_bytes(previous ? layout_.unit_bytes() : 0);
    for (uint64_t unit : units_by_holder[holder]) {
      const erasure::UnitLocation location = layout_.DataUnitLocation(position_, unit);
      const uint64_t length = layout_.UnitLength(image.bytes(), unit);
      image.Read(unit * layout_.unit_bytes(), length, buffer.data());
      if (previous) {  // the delta: old XOR new
        previous->Read(unit * layout_.unit_bytes(), length, old_bytes.data());
        for (uint64_t i = 0; i < length; ++i) buffer[i] ^= old_bytes[i];
      }
      FrameHeader header;
      header.kind = FrameKind::kParityDelta;
      header.step = step;
      header.rank = node_id_;
      header.stripe = location.stripe;
      header.stripe_unit = static_cast<uint32_t>(location.index);
      if (absl::Status status = SendFrames(NodeAt(holder), header, buffer.data(), length);
          !status.ok()) {
        return status;
      }
      sent += length;
    }
    return absl::OkStatus();
  });
  for (const absl::Status& status : statuses) {
    if (!status.ok()) return status;
  }
  return sent.load();
}

grpc::Status Cluster::Impl::Commit(grpc::ServerContext*, const v1::CommitRequest* request,
                                   v1::CommitResponse*) {
  const int64_t step = request->step();
  if (CommittedStep() == step) return grpc::Status::OK;  // a new coordinator finishing the step
  OpenStep open;
  {
    absl::MutexLock lock(&mutex_);
    auto it = open_.find(step);
    if (it == open_.end() || !it->second.encoded) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("step ", step, " is not encoded on node ", node_id_));
    }
    // A commit is sent only once the step is decided (every node encoded it), so it is accepted
    // from whichever coordinator finishes the step.
    open = it->second;
  }
  v1::JournalCluster record;
  record.set_committed_step(step);
  for (const v1::NodeImage& image : open.group_images) *record.add_group_images() = image;
  for (v1::JournalParity& parity : parity_.Records(step)) *record.add_parity() = std::move(parity);
  if (absl::Status status = store_->CommitNodeStep(step, record); !status.ok()) {
    return ToGrpcStatus(status);
  }
  parity_.Commit(step);
  absl::MutexLock lock(&mutex_);
  open_.erase(open_.begin(), open_.upper_bound(step));
  changed_.SignalAll();
  return grpc::Status::OK;
}

grpc::Status Cluster::Impl::Abort(grpc::ServerContext*, const v1::AbortRequest* request,
                                  v1::AbortResponse*) {
  const int64_t step = request->step();
  if (CommittedStep() == step) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("step ", step, " is already committed on node ", node_id_));
  }
  {
    // An abort can race its coordinator's commit only if it comes from elsewhere while that
    // coordinator lives: refused then.
    absl::MutexLock lock(&mutex_);
    auto it = open_.find(step);
    if (it != open_.end() && it->second.coordinator != request->coordinator() &&
        LiveLocked(it->second.coordinator)) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("step ", step, " belongs to coordinator ",
                                       it->second.coordinator, ", which is live"));
    }
  }
  store_->AbortNodeStep(step, absl::AbortedError(absl::StrCat(
                                  "the cluster aborted step ", step, ": ", request->reason())));
  parity_.Abort(step);
  absl::MutexLock lock(&mutex_);
  open_.erase(step);
  last_abort_ = absl::StrCat("step ", step, ": ", request->reason());
  return grpc::Status::OK;
}

grpc::Status Cluster::Impl::StepOutcome(grpc::ServerContext*, const v1::StepOutcomeRequest* request,
                                        v1::StepOutcomeResponse* response) {
  if (CommittedStep() == request->step()) {
    response->set_state(v1::STEP_STATE_COMMITTED);
    return grpc::Status::OK;
  }
  absl::MutexLock lock(&mutex_);
  auto it = open_.find(request->step());
  if (it != open_.end()) {
    response->set_state(it->second.encoded ? v1::STEP_STATE_ENCODED : v1::STEP_STATE_CAPTURED);
  }
  return grpc::Status::OK;
}

grpc::Status Cluster::Impl::GroupState(grpc::ServerContext*, const v1::GroupStateRequest*,
                                       v1::GroupStateResponse* response) {
  v1::JournalCluster record = store_->ClusterRecord();
  record.clear_parity();
  *response->mutable_cluster() = std::move(record);
  absl::MutexLock lock(&mutex_);
  response->set_rebuilding(rebuilding_ || !rebuild_error_.ok());
  return grpc::Status::OK;
}

grpc::Status Cluster::Impl::SendUnits(grpc::ServerContext*, const v1::SendUnitsRequest* request,
                                      v1::SendUnitsResponse* response) {
  const v1::JournalCluster record = store_->ClusterRecord();
  if (!record.has_committed_step() || record.committed_step() != request->step()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("node ", node_id_, " does not hold step ", request->step()));
  }
  const NodeImage image = store_->CommittedImage();
  std::vector<uint8_t> buffer;
  uint64_t sent = 0;
  for (const v1::UnitRef& ref : request->units()) {
    const erasure::StripeMembers members = layout_.Members(ref.stripe());
    FrameHeader header;
    header.kind = FrameKind::kFetchedUnit;
    header.step = request->step();
    header.rank = node_id_;
    header.stripe = ref.stripe();
    header.stripe_unit = ref.unit();
    const uint8_t* bytes = nullptr;
    uint64_t length = 0;
    if (ref.unit() < static_cast<uint32_t>(layout_.data_units()) &&
        members.data_positions[ref.unit()] == position_) {
      const uint64_t unit = layout_.DataUnitOf(position_, ref.stripe());
      length = layout_.UnitLength(image.bytes(), unit);
      buffer.resize(length);
      image.Read(unit * layout_.unit_bytes(), length, buffer.data());
      bytes = buffer.data();
    } else if (ref.unit() >= static_cast<uint32_t>(layout_.data_units()) &&
               ref.unit() < static_cast<uint32_t>(layout_.group_size()) &&
               members.parity_positions[ref.unit() - layout_.data_units()] == position_) {
      std::optional<ParityUnit> parity = parity_.Committed(ref.stripe());
      if (!parity) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND,
                            absl::StrCat("node ", node_id_, " holds no parity of stripe ",
                                         ref.stripe()));
      }
      if (erasure::Crc32c(parity->extent->data(), parity->bytes) != parity->crc) {
        return grpc::Status(grpc::StatusCode::DATA_LOSS,
                            absl::StrCat("node ", node_id_, ": parity of stripe ", ref.stripe(),
                                         " fails its CRC-32C (moesnapctl verify --repair)"));
      }
      bytes = parity->extent->data();
      length = parity->bytes;
    } else {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("node ", node_id_, " holds no unit ", ref.unit(),
                                       " of stripe ", ref.stripe()));
    }
    if (absl::Status status = SendFrames(request->to_node(), header, bytes, length); !status.ok()) {
      return ToGrpcStatus(status);
    }
    sent += length;
  }
  response->set_bytes(sent);
  return grpc::Status::OK;
}

absl::Status Cluster::Impl::Accept(const FrameHeader& header, absl::Span<const uint8_t> payload) {
  if (header.kind == FrameKind::kParityDelta) return parity_.Accept(header, payload);
  const FetchKey key = header.kind == FrameKind::kFetchedRegion
                           ? FetchKey{header.step, 0, 0, header.rank, header.region}
                           : FetchKey{header.step, header.stripe, header.stripe_unit, 0, ""};
  absl::MutexLock lock(&fetch_mutex_);
  auto it = fetches_.find(key);
  if (it == fetches_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(key.Describe(), " was not asked for"));
  }
  FetchSlot& slot = it->second;
  if (header.offset + payload.size() > slot.bytes || payload.size() > slot.missing) {
    return absl::InvalidArgumentError(absl::StrCat(key.Describe(), ": more bytes than asked for"));
  }
  std::memcpy(slot.buffer + header.offset, payload.data(), payload.size());
  slot.missing -= payload.size();
  if (slot.missing == 0) fetched_.SignalAll();
  return absl::OkStatus();
}

// --- Rebuild and repair --------------------------------------------------------------------------

std::vector<bool> Cluster::Impl::HoldersOf(int group, int64_t step, int excluded_position) {
  std::vector<int> positions(layout_.group_size());
  for (int position = 0; position < layout_.group_size(); ++position) positions[position] = position;
  std::vector<absl::Status> holds = InParallel(positions, [&](int position) -> absl::Status {
    if (position == excluded_position) return absl::NotFoundError("being rebuilt");
    grpc::ClientContext context;
    context.set_deadline(Deadline(absl::Seconds(2)));
    v1::GroupStateResponse response;
    const grpc::Status status = Stub(NodeAt(group, position))->GroupState(&context, {}, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    if (response.rebuilding() || !response.cluster().has_committed_step() ||
        response.cluster().committed_step() != step) {
      return absl::NotFoundError("does not hold the step");
    }
    return absl::OkStatus();
  });
  std::vector<bool> result;
  for (const absl::Status& status : holds) result.push_back(status.ok());
  return result;
}

void Cluster::Impl::ExpectFetches(const std::vector<std::pair<FetchKey, FetchSlot>>& slots) {
  absl::MutexLock lock(&fetch_mutex_);
  for (const auto& [key, slot] : slots) fetches_[key] = slot;
}

absl::Status Cluster::Impl::CollectFetches(const std::vector<FetchKey>& keys, absl::Status sent) {
  const absl::Time deadline = absl::Now() + kFetchWait;
  absl::MutexLock lock(&fetch_mutex_);
  for (const FetchKey& key : keys) {
    while (sent.ok() && fetches_[key].missing > 0) {
      if (fetched_.WaitWithDeadline(&fetch_mutex_, deadline)) {
        sent = absl::DeadlineExceededError(absl::StrCat(key.Describe(), " did not arrive"));
      }
    }
  }
  for (const FetchKey& key : keys) fetches_.erase(key);
  return sent;
}

absl::Status Cluster::Impl::RebuildStripes(const RebuildTarget& target,
                                           const std::vector<uint64_t>& stripes,
                                           v1::RebuildResponse* stats) {
  const int k = layout_.data_units();
  const int n = layout_.group_size();
  const int64_t step = target.record.committed_step();
  std::vector<uint64_t> sizes;
  for (const v1::NodeImage& image : target.record.group_images()) sizes.push_back(image.bytes());
  // Asked now, not taken from heartbeats: a peer may have committed since its last one.
  const std::vector<bool> holds = HoldersOf(target.group, step, target.position);

  struct Work {
    uint64_t stripe = 0;
    uint64_t length = 0;
    int mine = 0;                // this node's unit index in the stripe
    std::vector<int> chosen;     // k unit indices that decode the stripe
    std::vector<uint8_t*> units;  // n buffers of `length`, in the scratch space
  };
  // Scratch for a batch of stripes: from the pool when it has room (its pages are resident, so no
  // page faults), else from the heap.
  const uint64_t unit_span = layout_.unit_bytes() * n;
  const uint64_t scratch_bytes =
      std::max(unit_span, std::min<uint64_t>(kRebuildBatchBytes, unit_span * stripes.size()));
  std::shared_ptr<PoolExtent> pool_scratch;
  std::vector<uint8_t> heap_scratch;
  uint8_t* scratch = nullptr;
  if (absl::StatusOr<std::shared_ptr<PoolExtent>> extent = pool_->Allocate(scratch_bytes); extent.ok()) {
    pool_scratch = *std::move(extent);
    scratch = pool_scratch->data();
  } else {
    heap_scratch.resize(scratch_bytes);
    scratch = heap_scratch.data();
  }
  size_t next = 0;
  while (next < stripes.size()) {
    std::vector<Work> batch;
    uint64_t batch_bytes = 0;
    for (; next < stripes.size() && batch_bytes + unit_span <= scratch_bytes; ++next) {
      Work work;
      work.stripe = stripes[next];
      work.length = layout_.ParityLength(work.stripe, sizes);
      if (work.length == 0) continue;
      const erasure::StripeMembers members = layout_.Members(work.stripe);
      std::vector<int> position_of(n);
      for (int i = 0; i < k; ++i) position_of[i] = members.data_positions[i];
      for (int j = 0; j < n - k; ++j) position_of[k + j] = members.parity_positions[j];
      std::vector<int> zeros, data, parity;
      for (int i = 0; i < n; ++i) {
        const int position = position_of[i];
        if (position == target.position) {
          work.mine = i;
        } else if (i < k && layout_.UnitLength(sizes[position],
                                               layout_.DataUnitOf(position, work.stripe)) == 0) {
          zeros.push_back(i);  // virtually zero: known without asking anyone
        } else if (holds[position]) {
          (i < k ? data : parity).push_back(i);
        }
      }
      for (const std::vector<int>* list : {&zeros, &data, &parity}) {
        for (int i : *list) {
          if (static_cast<int>(work.chosen.size()) < k) work.chosen.push_back(i);
        }
      }
      if (static_cast<int>(work.chosen.size()) < k) {
        std::vector<uint32_t> lost;
        for (int position = 0; position < n; ++position) {
          if (!holds[position]) lost.push_back(NodeAt(target.group, position));
        }
        return absl::FailedPreconditionError(absl::StrCat(
            "group ", target.group, " [", absl::StrJoin(groups_[target.group], ", "),
            "] has lost nodes [", absl::StrJoin(lost, ", "), "]: more than m = ", n - k, " of its ",
            n, " nodes, so step ", step, " of node ", NodeAt(target.group, target.position),
            " can no longer be recovered (stripe ", work.stripe, " has ", work.chosen.size(),
            " of the ", k, " units it needs)"));
      }
      for (int i = 0; i < n; ++i) work.units.push_back(scratch + batch_bytes + i * work.length);
      batch_bytes += work.length * n;
      batch.push_back(std::move(work));
    }
    // Ask every source node for its units of the batch at once.
    std::map<uint32_t, v1::SendUnitsRequest> requests;
    std::vector<std::pair<FetchKey, FetchSlot>> slots;
    for (Work& work : batch) {
      const erasure::StripeMembers members = layout_.Members(work.stripe);
      for (int i : work.chosen) {
        const int position = i < k ? members.data_positions[i] : members.parity_positions[i - k];
        const uint64_t bytes =
            i < k ? layout_.UnitLength(sizes[position], layout_.DataUnitOf(position, work.stripe))
                  : work.length;
        // Inputs read as zero past the unit's own bytes (virtually padded); outputs need no fill.
        std::memset(work.units[i] + bytes, 0, work.length - bytes);
        if (bytes == 0) continue;
        slots.push_back({{step, work.stripe, static_cast<uint32_t>(i), 0, ""},
                         {work.units[i], bytes, bytes}});
        v1::SendUnitsRequest& request = requests[NodeAt(target.group, position)];
        request.set_to_node(node_id_);
        request.set_step(step);
        v1::UnitRef* ref = request.add_units();
        ref->set_stripe(work.stripe);
        ref->set_unit(static_cast<uint32_t>(i));
        stats->set_fetched_bytes(stats->fetched_bytes() + bytes);
      }
    }
    ExpectFetches(slots);
    std::vector<uint32_t> sources;
    for (const auto& [id, request] : requests) sources.push_back(id);
    std::vector<absl::Status> sent = InParallel(sources, [&](uint32_t id) -> absl::Status {
      grpc::ClientContext context;
      context.set_deadline(Deadline(absl::Minutes(10)));
      v1::SendUnitsResponse response;
      const grpc::Status status = Stub(id)->SendUnits(&context, requests[id], &response);
      if (!status.ok()) {
        return absl::Status(FromGrpcStatus(status).code(),
                            absl::StrCat("node ", id, ": ", status.error_message()));
      }
      return absl::OkStatus();
    });
    absl::Status status;
    for (const absl::Status& one : sent) status.Update(one);
    std::vector<FetchKey> keys;
    for (const auto& [key, slot] : slots) keys.push_back(key);
    if (status = CollectFetches(keys, status); !status.ok()) return status;

    for (Work& work : batch) {
      std::vector<int> erased;
      for (int i = 0; i < n; ++i) {
        if (std::find(work.chosen.begin(), work.chosen.end(), i) == work.chosen.end()) {
          erased.push_back(i);
        }
      }
      if (absl::Status decoded = codec_->Decode(work.units, erased, work.length); !decoded.ok()) {
        return decoded;
      }
      if (work.mine < k) {
        const uint64_t unit = layout_.DataUnitOf(target.position, work.stripe);
        const uint64_t bytes = layout_.UnitLength(sizes[target.position], unit);
        target.write_data(unit, work.units[work.mine], bytes);
        stats->set_data_bytes(stats->data_bytes() + bytes);
      } else if (target.parity != nullptr) {
        ParityUnit& parity = (*target.parity)[work.stripe];
        std::memcpy(parity.extent->data(), work.units[work.mine], work.length);
        parity.crc = erasure::Crc32c(parity.extent->data(), work.length);
        stats->set_parity_bytes(stats->parity_bytes() + work.length);
      }
      stats->set_stripes(stats->stripes() + 1);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::RebuildResponse> Cluster::Impl::RebuildSelf(bool force) {
  absl::MutexLock rebuild_lock(&rebuild_mutex_);
  const absl::Time started = absl::Now();
  // The group's record of its latest committed step, from the members that hold it.
  std::optional<v1::JournalCluster> record;
  for (uint32_t id : groups_[group_]) {
    if (id == node_id_) continue;
    grpc::ClientContext context;
    context.set_deadline(Deadline(absl::Seconds(2)));
    v1::GroupStateResponse response;
    if (!Stub(id)->GroupState(&context, {}, &response).ok() || response.rebuilding() ||
        !response.cluster().has_committed_step()) {
      continue;
    }
    if (!record || response.cluster().committed_step() > record->committed_step()) {
      record = response.cluster();
    }
  }
  const std::optional<int64_t> mine = CommittedStep();
  v1::RebuildResponse stats;
  if (!record || (mine && *mine >= record->committed_step() && !force)) {
    if (mine) stats.set_step(*mine);
    return stats;  // nothing newer in the group: this node is current
  }
  const int64_t step = record->committed_step();
  stats.set_step(step);
  if (record->group_images_size() != layout_.group_size() ||
      record->group_images(position_).node_id() != node_id_) {
    return absl::DataLossError(absl::StrCat("the group's record of step ", step,
                                            " does not list node ", node_id_, " at position ",
                                            position_));
  }
  Log(LogLevel::kInfo, "rebuilding node ", node_id_, "'s step ", step, " (",
      record->group_images(position_).bytes(), " bytes of data) from group ", group_);
  absl::StatusOr<NodeImage> image = NodeImage::Allocate(pool_, record->group_images(position_));
  if (!image.ok()) return image.status();
  std::vector<uint64_t> sizes;
  for (const v1::NodeImage& member : record->group_images()) sizes.push_back(member.bytes());
  std::map<uint64_t, ParityUnit> parity;
  std::vector<uint64_t> stripes;
  const uint64_t stripe_count = layout_.StripeCount(sizes);
  for (uint64_t stripe = 0; stripe < stripe_count; ++stripe) {
    if (layout_.IsParityPosition(stripe, position_)) {
      const uint64_t bytes = layout_.ParityLength(stripe, sizes);
      if (bytes == 0) continue;
      absl::StatusOr<std::shared_ptr<PoolExtent>> extent = pool_->Allocate(bytes);
      if (!extent.ok()) return extent.status();
      parity[stripe] = {stripe, bytes, 0, *std::move(extent)};
    } else if (layout_.UnitLength(sizes[position_], layout_.DataUnitOf(position_, stripe)) == 0) {
      continue;
    }
    stripes.push_back(stripe);
  }
  const NodeImage& rebuilt = *image;
  RebuildTarget target{*record, group_, position_,
                       [&](uint64_t unit, const uint8_t* bytes, uint64_t length) {
                         rebuilt.Write(unit * layout_.unit_bytes(), bytes, length);
                       },
                       &parity};
  if (absl::Status status = RebuildStripes(target, stripes, &stats); !status.ok()) return status;
  if (std::vector<std::pair<int, uint32_t>> corrupt = image->CorruptChunks(); !corrupt.empty()) {
    const v1::ImageRegion& region = image->manifest().regions(corrupt[0].first);
    return absl::DataLossError(absl::StrCat(
        "rebuilt data of step ", step, " fails ", corrupt.size(), " chunk CRCs (first: region '",
        region.region(), "' of rank ", region.rank(), ", chunk ", corrupt[0].second,
        "): a survivor's units are corrupt"));
  }
  v1::JournalCluster installed = *record;
  installed.clear_parity();
  std::vector<ParityUnit> units;
  for (auto& [stripe, unit] : parity) {
    *installed.add_parity() = ParityStore::RecordOf(unit);
    units.push_back(unit);
  }
  if (absl::Status status = store_->InstallImage(*image, installed); !status.ok()) return status;
  parity_.Install(step, std::move(units));
  stats.set_seconds(absl::ToDoubleSeconds(absl::Now() - started));
  Log(LogLevel::kInfo, "rebuilt step ", step, ": ", stats.stripes(), " stripes, ",
      stats.data_bytes(), " bytes of data and ", stats.parity_bytes(), " of parity from ",
      stats.fetched_bytes(), " fetched, in ", stats.seconds(), " s");
  return stats;
}

bool Cluster::Impl::SleepUnlessStopping(absl::Duration duration) {
  const absl::Time until = absl::Now() + duration;
  absl::MutexLock lock(&mutex_);
  while (!stopping_ && !changed_.WaitWithDeadline(&mutex_, until)) {
  }
  return !stopping_;
}

void Cluster::Impl::RebuildAtStart() {
  // Give the heartbeats a moment to find which peers are up and what they hold.
  if (!SleepUnlessStopping(heartbeat_interval_ * 3)) return;
  // A peer that restarts or a connection that breaks fails one attempt; too few survivors fail
  // every attempt the same way, and that answer is final.
  absl::StatusOr<v1::RebuildResponse> rebuilt = RebuildSelf(/*force=*/false);
  for (int attempt = 1; attempt < kRebuildAttempts && !rebuilt.ok() &&
                        (absl::IsUnavailable(rebuilt.status()) ||
                         absl::IsDeadlineExceeded(rebuilt.status()));
       ++attempt) {
    Log(LogLevel::kWarning, "rebuild attempt ", attempt, " failed, retrying: ",
        rebuilt.status().ToString());
    if (!SleepUnlessStopping(absl::Milliseconds(options_.heartbeat_timeout_ms))) return;
    rebuilt = RebuildSelf(/*force=*/false);
  }
  absl::MutexLock lock(&mutex_);
  rebuilding_ = false;
  if (!rebuilt.ok()) {
    rebuild_error_ = rebuilt.status();
    Log(LogLevel::kError, "rebuild failed: ", rebuilt.status().ToString());
  }
  changed_.SignalAll();
}

absl::StatusOr<v1::RebuildResponse> Cluster::Impl::RebuildNode(uint32_t node_id) {
  if (node_id != node_id_) {
    if (!options_.GroupOf(node_id)) {
      return absl::NotFoundError(absl::StrCat("node ", node_id, " is not in the cluster"));
    }
    grpc::ClientContext context;
    context.set_deadline(Deadline(absl::Hours(1)));
    v1::RebuildResponse response;
    const grpc::Status status = Stub(node_id)->Rebuild(&context, {}, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    return response;
  }
  {
    absl::MutexLock lock(&mutex_);
    rebuilding_ = true;
  }
  absl::StatusOr<v1::RebuildResponse> rebuilt = RebuildSelf(/*force=*/true);
  absl::MutexLock lock(&mutex_);
  rebuilding_ = false;
  rebuild_error_ = rebuilt.status();
  changed_.SignalAll();
  return rebuilt;
}

grpc::Status Cluster::Impl::Rebuild(grpc::ServerContext*, const v1::PeerRebuildRequest*,
                                    v1::RebuildResponse* response) {
  absl::StatusOr<v1::RebuildResponse> rebuilt = RebuildNode(node_id_);
  if (!rebuilt.ok()) return ToGrpcStatus(rebuilt.status());
  *response = *std::move(rebuilt);
  return grpc::Status::OK;
}

absl::StatusOr<v1::VerifyResponse> Cluster::Impl::Verify(std::optional<int64_t> step, bool repair) {
  // Counts the parity units checked and corrupt into `out`; returns the stripes of the corrupt ones.
  auto check_parity = [this](v1::VerifyResponse& out) {
    std::set<uint64_t> corrupt;
    for (const ParityUnit& unit : parity_.CommittedUnits()) {
      out.set_parity_units_checked(out.parity_units_checked() + 1);
      if (erasure::Crc32c(unit.extent->data(), unit.bytes) != unit.crc) {
        out.set_parity_units_corrupt(out.parity_units_corrupt() + 1);
        corrupt.insert(unit.stripe);
      }
    }
    return corrupt;
  };
  v1::VerifyResponse response = store_->Verify(step);
  std::set<uint64_t> stripes = check_parity(response);
  if (!repair || (response.corruptions_size() == 0 && response.parity_units_corrupt() == 0)) {
    return response;
  }
  absl::MutexLock rebuild_lock(&rebuild_mutex_);
  const v1::JournalCluster record = store_->ClusterRecord();
  const NodeImage image = store_->CommittedImage();
  if (!record.has_committed_step() || record.group_images_size() != layout_.group_size()) {
    return absl::FailedPreconditionError("this node has no committed step recorded for its group");
  }
  std::map<std::pair<uint32_t, std::string>, int> region_index;
  for (int i = 0; i < image.manifest().regions_size(); ++i) {
    region_index[{image.manifest().regions(i).rank(), image.manifest().regions(i).region()}] = i;
  }
  for (const v1::VerifyResponse::Corruption& corruption : response.corruptions()) {
    auto it = region_index.find({corruption.rank(), corruption.region()});
    if (it == region_index.end()) continue;
    const auto [begin, bytes] = image.ChunkRange(it->second, corruption.chunk());
    for (uint64_t unit = begin / layout_.unit_bytes(); unit <= (begin + bytes - 1) / layout_.unit_bytes();
         ++unit) {
      stripes.insert(layout_.DataUnitLocation(position_, unit).stripe);
    }
  }
  std::map<uint64_t, ParityUnit> parity;
  for (const ParityUnit& unit : parity_.CommittedUnits()) parity[unit.stripe] = unit;
  v1::RebuildResponse stats;
  RebuildTarget target{record, group_, position_,
                       [&](uint64_t unit, const uint8_t* bytes, uint64_t length) {
                         image.Write(unit * layout_.unit_bytes(), bytes, length);
                       },
                       &parity};
  if (absl::Status status = RebuildStripes(target, {stripes.begin(), stripes.end()}, &stats);
      !status.ok()) {
    return status;
  }
  // Report what was checked, what was repaired, and what is still wrong after the repair.
  v1::VerifyResponse after = store_->Verify(step);
  check_parity(after);
  v1::VerifyResponse result = response;
  *result.mutable_corruptions() = after.corruptions();
  result.set_chunks_repaired(response.corruptions_size() - after.corruptions_size());
  result.set_parity_units_repaired(response.parity_units_corrupt() - after.parity_units_corrupt());
  result.set_parity_units_corrupt(after.parity_units_corrupt());
  Log(LogLevel::kInfo, "repair: ", result.chunks_repaired(), " chunks and ",
      result.parity_units_repaired(), " parity units rebuilt from group ", group_);
  return result;
}

v1::ClusterStatusResponse Cluster::Impl::Status() const {
  v1::ClusterStatusResponse response;
  response.set_node_id(node_id_);
  response.set_full_encodes(full_encodes_);
  response.set_delta_encodes(delta_encodes_);
  response.set_parity_bytes_sent(parity_bytes_sent_);
  response.mutable_shape()->set_data_units(options_.data_units);
  response.mutable_shape()->set_parity_units(options_.parity_units);
  response.mutable_shape()->set_stripe_unit_bytes(options_.stripe_unit_bytes);
  const std::optional<int64_t> mine = CommittedStep();
  if (mine) response.set_latest_committed_step(*mine);
  const v1::NodeMemory memory = Memory();
  absl::MutexLock lock(&mutex_);
  response.set_last_abort(last_abort_);
  const uint32_t coordinator = CoordinatorLocked();
  for (const auto& [id, peer] : peers_) {
    v1::ClusterNodeStatus* node = response.add_nodes();
    node->set_node_id(id);
    node->set_host(peer.node.host);
    node->set_control_port(peer.node.control_port);
    node->set_data_port(peer.node.data_port);
    const auto [group, position] = *options_.GroupOf(id);
    node->set_group(group);
    node->set_position(position);
    node->set_live(LiveLocked(id));
    node->set_coordinator(id == coordinator);
    if (id == node_id_) {
      if (mine) node->set_latest_committed_step(*mine);
      node->set_rebuilding(rebuilding_ || !rebuild_error_.ok());
      *node->mutable_memory() = memory;
      continue;
    }
    node->set_silent_ms(peer.last_seen == absl::InfinitePast()
                            ? -1
                            : absl::ToInt64Milliseconds(absl::Now() - peer.last_seen));
    if (peer.last.has_latest_committed_step()) {
      node->set_latest_committed_step(peer.last.latest_committed_step());
    }
    node->set_rebuilding(peer.last.rebuilding());
    *node->mutable_memory() = peer.last.memory();
  }
  return response;
}

// --- Elastic restore -----------------------------------------------------------------------------

grpc::Status Cluster::Impl::LocateRank(grpc::ServerContext*, const v1::LocateRankRequest* request,
                                       v1::LocateRankResponse* response) {
  v1::JournalCluster record = store_->ClusterRecord();
  record.clear_parity();
  for (const v1::NodeImage& image : record.group_images()) {
    for (const v1::ImageRegion& region : image.regions()) {
      if (region.rank() != request->rank()) continue;
      response->set_found(true);
      response->set_node_id(image.node_id());
      *response->mutable_record() = std::move(record);
      return grpc::Status::OK;
    }
  }
  return grpc::Status::OK;
}

grpc::Status Cluster::Impl::SendRegion(grpc::ServerContext*, const v1::SendRegionRequest* request,
                                       v1::SendRegionResponse* response) {
  if (CommittedStep() != request->step()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("node ", node_id_, " does not hold step ", request->step()));
  }
  const NodeImage image = store_->CommittedImage();
  for (int i = 0; i < image.manifest().regions_size(); ++i) {
    const v1::ImageRegion& region = image.manifest().regions(i);
    if (region.rank() != request->rank() || region.region() != request->region()) continue;
    FrameHeader header;
    header.kind = FrameKind::kFetchedRegion;
    header.step = request->step();
    header.rank = request->rank();
    header.region = request->region();
    if (absl::Status status =
            SendFrames(request->to_node(), header, image.extents()[i]->data(), region.bytes());
        !status.ok()) {
      return ToGrpcStatus(status);
    }
    response->set_bytes(region.bytes());
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::NOT_FOUND,
                      absl::StrCat("node ", node_id_, " holds no region '", request->region(),
                                   "' of rank ", request->rank()));
}

absl::StatusOr<v1::RestoreResponse> Cluster::Impl::RestoreFrom(
    uint32_t rank, uint32_t source_rank, const std::vector<std::string>& names) {
  // This node's own committed state first; NOT_FOUND means the rank ran elsewhere.
  absl::StatusOr<v1::RestoreResponse> local = store_->RestoreFromRank(rank, source_rank, names);
  if (!absl::IsNotFound(local.status())) return local;
  // Which node holds the rank: any live node of its group knows.
  std::vector<uint32_t> nodes;
  for (const ClusterNode& node : options_.nodes) {
    if (Live(node.id)) nodes.push_back(node.id);
  }
  absl::Mutex found_mutex;
  std::optional<v1::LocateRankResponse> found;
  InParallel(nodes, [&](uint32_t id) -> absl::Status {
    grpc::ClientContext context;
    context.set_deadline(Deadline(kControlDeadline));
    v1::LocateRankRequest request;
    request.set_rank(source_rank);
    v1::LocateRankResponse response;
    const grpc::Status status = Stub(id)->LocateRank(&context, request, &response);
    if (status.ok() && response.found()) {
      absl::MutexLock lock(&found_mutex);
      if (!found || response.record().committed_step() > found->record().committed_step()) {
        found = std::move(response);
      }
    }
    return FromGrpcStatus(status);
  });
  if (!found) {
    return absl::NotFoundError(absl::StrCat("no live node of the cluster knows rank ", source_rank));
  }
  const v1::JournalCluster& record = found->record();
  const int64_t step = record.committed_step();
  const auto [group, position] = *options_.GroupOf(found->node_id());
  const v1::NodeImage& holder_image = record.group_images(position);
  const bool holder_live = HoldersOf(group, step, -1)[position];

  // The requested regions of the rank, with their offsets in the holder's image.
  struct Wanted {
    const v1::ImageRegion* region;
    uint64_t start;
    std::vector<uint8_t> bytes;
  };
  std::vector<Wanted> wanted;
  uint64_t offset = 0;
  for (const v1::ImageRegion& region : holder_image.regions()) {
    offset += region.bytes();
    if (region.rank() != source_rank) continue;
    if (!names.empty() && std::find(names.begin(), names.end(), region.region()) == names.end()) {
      continue;
    }
    wanted.push_back({&region, offset - region.bytes(), std::vector<uint8_t>(region.bytes())});
  }
  if (wanted.empty()) {
    return absl::NotFoundError(absl::StrCat("rank ", source_rank, " has none of the regions asked for"));
  }
  if (holder_live) {
    for (Wanted& region : wanted) {
      const FetchKey key{step, 0, 0, source_rank, region.region->region()};
      ExpectFetches({{key, {region.bytes.data(), region.bytes.size(), region.bytes.size()}}});
      grpc::ClientContext context;
      context.set_deadline(Deadline(absl::Minutes(5)));
      v1::SendRegionRequest request;
      request.set_to_node(node_id_);
      request.set_step(step);
      request.set_rank(source_rank);
      request.set_region(region.region->region());
      v1::SendRegionResponse sent;
      if (absl::Status status = CollectFetches(
              {key}, FromGrpcStatus(Stub(found->node_id())->SendRegion(&context, request, &sent)));
          !status.ok()) {
        return status;
      }
    }
  } else {
    // Decode the holder's units that cover the regions from its group's survivors, each once.
    std::set<uint64_t> stripes;
    for (const Wanted& region : wanted) {
      if (region.bytes.empty()) continue;
      for (uint64_t unit = region.start / layout_.unit_bytes();
           unit <= (region.start + region.bytes.size() - 1) / layout_.unit_bytes(); ++unit) {
        stripes.insert(layout_.DataUnitLocation(position, unit).stripe);
      }
    }
    RebuildTarget target{record, group, position,
                         [&](uint64_t unit, const uint8_t* data, uint64_t length) {
                           const uint64_t unit_start = unit * layout_.unit_bytes();
                           for (Wanted& region : wanted) {
                             const uint64_t from = std::max(unit_start, region.start);
                             const uint64_t to = std::min(unit_start + length,
                                                          region.start + region.bytes.size());
                             if (from < to) {
                               std::memcpy(region.bytes.data() + (from - region.start),
                                           data + (from - unit_start), to - from);
                             }
                           }
                         },
                         nullptr};
    v1::RebuildResponse stats;
    absl::MutexLock rebuild_lock(&rebuild_mutex_);
    if (absl::Status status = RebuildStripes(target, {stripes.begin(), stripes.end()}, &stats);
        !status.ok()) {
      return status;
    }
  }
  v1::RestoreResponse response;
  response.set_step(step);
  for (const Wanted& region : wanted) {
    if (absl::Status status = store_->WriteRegion(rank, *region.region, region.bytes.data());
        !status.ok()) {
      return status;
    }
    v1::RestoreResponse::Restored* restored = response.add_regions();
    restored->set_region(region.region->region());
    restored->set_step(region.region->step());
    restored->set_bytes(region.region->bytes());
  }
  Log(LogLevel::kInfo, "restored ", response.regions_size(), " regions of rank ", source_rank,
      " (node ", found->node_id(), holder_live ? ", fetched" : ", lost: decoded from its group",
      ") into rank ", rank);
  return response;
}

// --- Upstream log ---------------------------------------------------------------------------------

grpc::Status Cluster::Impl::FetchLog(grpc::ServerContext*, const v1::FetchLogRequest* request,
                                     v1::FetchLogResponse* response) {
  absl::StatusOr<v1::FetchLogResponse> fetched = log_->Fetch(*request);
  if (!fetched.ok()) return ToGrpcStatus(fetched.status());
  *response = *std::move(fetched);
  return grpc::Status::OK;
}

absl::StatusOr<v1::FetchLogResponse> Cluster::Impl::FetchRemoteLog(
    const v1::FetchLogRequest& request) {
  // The trainer does not know where its neighbour ran: ask every other live node; the one that
  // holds the rank's log answers, the others say NOT_FOUND.
  std::vector<uint32_t> nodes;
  std::vector<uint32_t> lost;
  for (const ClusterNode& node : options_.nodes) {
    if (node.id == node_id_) continue;
    (Live(node.id) ? nodes : lost).push_back(node.id);
  }
  absl::Mutex found_mutex;
  std::optional<absl::StatusOr<v1::FetchLogResponse>> found;
  const std::vector<absl::Status> statuses = InParallel(nodes, [&](uint32_t id) -> absl::Status {
    grpc::ClientContext context;
    context.set_deadline(Deadline(kControlDeadline));
    v1::FetchLogResponse response;
    const absl::Status status = FromGrpcStatus(Stub(id)->FetchLog(&context, request, &response));
    if (absl::IsNotFound(status) || absl::IsUnavailable(status)) return status;
    absl::MutexLock lock(&found_mutex);
    // A node that ran the rank once may hold an older, emptier log than the one it runs on now.
    if (status.ok() && (!found || !found->ok() ||
                        response.records_size() > (*found)->records_size())) {
      found = std::move(response);
    } else if (!found) {
      found = status;
    }
    return status;
  });
  if (found) return *std::move(found);
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (absl::IsUnavailable(statuses[i])) lost.push_back(nodes[i]);
  }
  return absl::NotFoundError(absl::StrCat(
      "no live node holds an upstream log of rank ", request.rank(),
      lost.empty() ? std::string()
                   : absl::StrCat(" (nodes [", absl::StrJoin(lost, ", "),
                                  "] are lost or did not answer; a log held there is gone)")));
}

// --- Cluster -------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Start(uint32_t node_id,
                                                        const ClusterOptions& options, Pool* pool,
                                                        Store* store, UpstreamLog* log,
                                                        const durable::DurableDirectory* durable) {
  if (options.allow_degraded) {
    return absl::UnimplementedError(
        "cluster.allow_degraded = true is not supported yet: a degraded commit needs parity "
        "deltas against the lost node's last image; set it to false (the default)");
  }
  absl::StatusOr<erasure::StripeLayout> layout = erasure::StripeLayout::Create(
      options.data_units, options.parity_units, options.stripe_unit_bytes);
  if (!layout.ok()) return layout.status();
  absl::StatusOr<std::unique_ptr<erasure::ReedSolomon>> codec =
      erasure::ReedSolomon::Create(options.data_units, options.parity_units);
  if (!codec.ok()) return codec.status();
  auto impl = std::make_unique<Impl>(node_id, options, pool, store, log, durable,
                                     *std::move(layout), *std::move(codec));
  if (absl::Status status = impl->Start(); !status.ok()) return status;
  return std::unique_ptr<Cluster>(new Cluster(std::move(impl)));
}

Cluster::Cluster(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Cluster::~Cluster() = default;

v1::ClusterStatusResponse Cluster::Status() const { return impl_->Status(); }

void Cluster::set_crash_in_commit_for_testing(int64_t step) { impl_->set_crash_in_commit(step); }

absl::StatusOr<v1::RebuildResponse> Cluster::Rebuild(uint32_t node_id) {
  return impl_->RebuildNode(node_id);
}

absl::StatusOr<v1::RestoreResponse> Cluster::RestoreFrom(uint32_t rank, uint32_t source_rank,
                                                         const std::vector<std::string>& regions) {
  return impl_->RestoreFrom(rank, source_rank, regions);
}

absl::StatusOr<v1::FetchLogResponse> Cluster::FetchLog(const v1::FetchLogRequest& request) {
  return impl_->FetchRemoteLog(request);
}

absl::StatusOr<v1::VerifyResponse> Cluster::Verify(std::optional<int64_t> step, bool repair) {
  return impl_->Verify(step, repair);
}

absl::Status Cluster::WaitMemory(absl::Time deadline) { return impl_->WaitMemory(deadline); }

durable::PeerSurvey Cluster::SurveyPeers(absl::Time deadline) {
  return impl_->SurveyPeers(deadline);
}

}  // namespace moesnap::daemon
