// The in-process cluster's fakes and wiring.
#include "tests/daemon/cluster/in_process_cluster.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "erasure/crc32c.h"
#include "tests/testing/deterministic_bytes.h"

namespace moesnap::daemon::cluster::testing {
namespace {

constexpr uint64_t kChunkBytes = 16 << 10;
// Two stripes of a (4,2) group's units of the default size (each its k = 4 sources and the unit
// decoded, HelperStripeBytes): a rebuild of more than a few stripes sends each helper several
// requests in turn.
constexpr uint64_t kHelperRequestBytes = 2 * 5 * InProcessCluster::kStripeUnitBytes;
constexpr uint64_t kTestPoolBytes = 64 << 20;
constexpr absl::Duration kWait = absl::Seconds(20);

}  // namespace

std::vector<uint8_t> StateOf(uint32_t node, int64_t step, uint64_t bytes, uint64_t kept_bytes) {
  auto bytes_of = [node](int64_t at, uint64_t length) {
    return moesnap::testing::DeterministicBytes(uint64_t{node} << 40 ^ static_cast<uint64_t>(at))
        .Bytes(length);
  };
  std::vector<uint8_t> state = bytes_of(0, kept_bytes);
  const std::vector<uint8_t> captured = bytes_of(step, bytes - kept_bytes);
  state.insert(state.end(), captured.begin(), captured.end());
  return state;
}

// --- FakeClusterStore -----------------------------------------------------------------------------

FakeClusterStore::FakeClusterStore(Pool* pool, uint32_t node) : pool_(pool), node_(node) {}

void FakeClusterStore::Capture(int64_t step, uint64_t bytes,
                               const std::vector<v1::ReplicaGroupStep>& layouts,
                               uint64_t kept_bytes) {
  std::vector<uint8_t> state = StateOf(node_, step, bytes, kept_bytes);
  v1::NodeImage manifest;
  manifest.set_node_id(node_);
  manifest.set_step(step);
  manifest.set_bytes(bytes);
  auto add_region = [&](const std::string& name, int64_t at, uint64_t offset, uint64_t length) {
    v1::ImageRegion* region = manifest.add_regions();
    region->set_rank(node_);
    region->set_region(name);
    region->set_step(at);
    region->set_bytes(length);
    region->set_dtype("uint8");
    region->add_shape(static_cast<int64_t>(length));
    region->set_chunk_bytes(kChunkBytes);
    for (uint64_t chunk = 0; chunk < length; chunk += kChunkBytes) {
      region->add_chunk_crcs(
          erasure::Crc32c(state.data() + offset + chunk, std::min(kChunkBytes, length - chunk)));
    }
  };
  if (kept_bytes > 0) add_region("kept", 0, 0, kept_bytes);
  absl::MutexLock lock(&mutex_);
  const int state_regions = state_regions_;
  const uint64_t each = (bytes - std::min(kept_bytes, bytes) + state_regions - 1) / state_regions;
  // A region not captured anew keeps the step and bytes it was last captured with.
  const bool sparse = recaptured_ && state_steps_.size() == static_cast<size_t>(state_regions);
  state_steps_.resize(state_regions);
  for (int i = 0; i < state_regions && kept_bytes + i * each < bytes; ++i) {
    const uint64_t offset = kept_bytes + i * each;
    const uint64_t length = std::min(each, bytes - offset);
    if (sparse && !recaptured_(i, step)) {
      const std::vector<uint8_t> then = StateOf(node_, state_steps_[i], bytes, kept_bytes);
      std::copy_n(then.begin() + offset, length, state.begin() + offset);
    } else {
      state_steps_[i] = step;
    }
    add_region(state_regions == 1 ? "state" : absl::StrCat("state.", i), state_steps_[i], offset,
               length);
  }
  if (!layouts.empty()) {
    v1::JournalRank* record = manifest.add_ranks();
    record->set_rank(node_);
    record->set_latest_committed_step(step);
    for (const v1::ReplicaGroupStep& layout : layouts) *record->add_replica_groups() = layout;
  }
  absl::StatusOr<NodeImage> image = NodeImage::Allocate(pool_, manifest);
  ASSERT_TRUE(image.ok()) << image.status();
  image->Write(0, state.data(), bytes);
  captured_[step] = *std::move(image);
  captured_state_[step] = std::move(state);
  offered_.erase(step);
  latest_ = step;
  changed_.SignalAll();
}

void FakeClusterStore::FlipCommittedByte(uint64_t offset) {
  absl::MutexLock lock(&mutex_);
  uint8_t byte = 0;
  committed_.Read(offset, 1, &byte);
  byte ^= 0xff;
  committed_.Write(offset, &byte, 1);
}

void FakeClusterStore::Rewind(int64_t step) {
  absl::MutexLock lock(&mutex_);
  for (auto it = captured_.upper_bound(step); it != captured_.end();) {
    aborted_.push_back(it->first);
    it = captured_.erase(it);
  }
  latest_ = step;
  changed_.SignalAll();
}

NodeCapture FakeClusterStore::CaptureOf(int64_t step) const {
  absl::MutexLock lock(&mutex_);
  if (captured_.contains(step)) return NodeCapture::kCaptured;
  return latest_ && *latest_ > step ? NodeCapture::kPassed : NodeCapture::kNotYet;
}

std::vector<int64_t> FakeClusterStore::aborted() const {
  absl::MutexLock lock(&mutex_);
  return aborted_;
}

std::vector<int64_t> FakeClusterStore::commits() const {
  absl::MutexLock lock(&mutex_);
  return commits_;
}

std::vector<uint8_t> FakeClusterStore::CapturedStateOf(int64_t step) const {
  absl::MutexLock lock(&mutex_);
  auto it = captured_state_.find(step);
  return it == captured_state_.end() ? std::vector<uint8_t>() : it->second;
}

std::vector<uint8_t> FakeClusterStore::CommittedBytesOf() const {
  absl::MutexLock lock(&mutex_);
  std::vector<uint8_t> bytes(committed_.bytes());
  committed_.Read(0, bytes.size(), bytes.data());
  return bytes;
}

absl::StatusOr<int64_t> FakeClusterStore::WaitNewNodeCapture(absl::Time deadline) {
  absl::MutexLock lock(&mutex_);
  while (true) {
    for (const auto& [step, image] : captured_) {
      if (offered_.insert(step).second) return step;
    }
    if (changed_.WaitWithDeadline(&mutex_, deadline)) {
      return absl::DeadlineExceededError("nothing newly captured");
    }
  }
}

absl::StatusOr<NodeImage> FakeClusterStore::WaitNodeCaptured(int64_t step, absl::Time deadline) {
  absl::MutexLock lock(&mutex_);
  while (!captured_.contains(step)) {
    if (changed_.WaitWithDeadline(&mutex_, deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("step ", step, " is not captured on node ",
                                                      node_));
    }
  }
  return captured_[step];
}

NodeImage FakeClusterStore::CommittedImage() const {
  absl::MutexLock lock(&mutex_);
  return committed_;
}

absl::StatusOr<std::vector<std::shared_ptr<PoolBytes>>> FakeClusterStore::CommittedBytesOf(
    const v1::NodeImage& image, absl::Span<const int> positions) const {
  std::vector<std::shared_ptr<PoolBytes>> stored(image.regions_size());
  absl::MutexLock lock(&mutex_);
  const v1::NodeImage& held = committed_.manifest();
  for (int position : positions) {
    if (position < 0 || position >= image.regions_size()) {
      return absl::InvalidArgumentError(absl::StrCat("position ", position, " out of range"));
    }
    const v1::ImageRegion& named = image.regions(position);
    auto same = [&](const v1::ImageRegion& region) {
      return region.rank() == named.rank() && region.region() == named.region() &&
             region.step() == named.step() && region.bytes() == named.bytes();
    };
    const auto found = std::find_if(held.regions().begin(), held.regions().end(), same);
    if (found == held.regions().end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node ", node_, "'s committed step holds no version of region '", named.region(),
          "' of step ", named.step()));
    }
    stored[position] = committed_.stored()[found - held.regions().begin()];
  }
  return stored;
}

absl::StatusOr<ClusterStore::HeldRegion> FakeClusterStore::CommittedRegion(
    int64_t step, uint32_t rank, const std::string& region) const {
  absl::MutexLock lock(&mutex_);
  if (!record_->has_committed_step() || record_->committed_step() != step) {
    return absl::FailedPreconditionError(absl::StrCat("step ", step, " is not the committed step"));
  }
  for (int i = 0; i < committed_.manifest().regions_size(); ++i) {
    const v1::ImageRegion& held = committed_.manifest().regions(i);
    if (held.rank() == rank && held.region() == region) {
      return HeldRegion{held, committed_.stored()[i]};
    }
  }
  return absl::NotFoundError(absl::StrCat("no region '", region, "' of rank ", rank));
}

absl::StatusOr<std::shared_ptr<const v1::JournalCluster>> FakeClusterStore::CommitNodeStep(
    int64_t step, v1::JournalCluster cluster, std::vector<std::string> image_bytes) {
  // The store journals the images as these bytes without reading them: here they are checked.
  if (image_bytes.size() != static_cast<size_t>(cluster.group_images_size())) {
    return absl::InvalidArgumentError(absl::StrCat(image_bytes.size(), " serialized images for ",
                                                   cluster.group_images_size()));
  }
  for (int i = 0; i < cluster.group_images_size(); ++i) {
    if (cluster.group_images(i).SerializeAsString() != image_bytes[i]) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step, ": image ", i,
                                                     " is not the bytes given for it"));
    }
  }
  absl::MutexLock lock(&mutex_);
  auto it = captured_.find(step);
  if (it == captured_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("node ", node_, " did not capture step ", step));
  }
  committed_ = it->second;
  captured_.erase(captured_.begin(), std::next(it));
  captured_state_.erase(captured_state_.begin(), captured_state_.lower_bound(step));
  record_ = std::make_shared<v1::JournalCluster>(std::move(cluster));
  record_bytes_ = std::make_shared<std::vector<std::string>>(std::move(image_bytes));
  commits_.push_back(step);
  changed_.SignalAll();
  return record_;
}

void FakeClusterStore::AbortNodeStep(int64_t step, const absl::Status&) {
  absl::MutexLock lock(&mutex_);
  if (captured_.erase(step) > 0) aborted_.push_back(step);
  changed_.SignalAll();
}

absl::Status FakeClusterStore::InstallImage(const NodeImage& image, v1::JournalCluster cluster) {
  absl::MutexLock lock(&mutex_);
  committed_ = image;
  auto bytes = std::make_shared<std::vector<std::string>>(SerializedImages(cluster));
  record_ = std::make_shared<v1::JournalCluster>(std::move(cluster));
  record_bytes_ = std::move(bytes);
  changed_.SignalAll();
  return absl::OkStatus();
}

void FakeClusterStore::ForgetClusterRecord() {
  absl::MutexLock lock(&mutex_);
  record_ = std::make_shared<v1::JournalCluster>();
  record_bytes_ = std::make_shared<std::vector<std::string>>();
  changed_.SignalAll();
}

std::shared_ptr<const v1::JournalCluster> FakeClusterStore::ClusterRecord() const {
  absl::MutexLock lock(&mutex_);
  return record_;
}

ClusterStore::RecordWithBytes FakeClusterStore::ClusterRecordWithBytes() const {
  absl::MutexLock lock(&mutex_);
  return {record_, record_bytes_};
}

uint64_t FakeClusterStore::CommittedBytes() const {
  absl::MutexLock lock(&mutex_);
  return committed_.bytes();
}

uint64_t FakeClusterStore::InFlightBytes() const {
  absl::MutexLock lock(&mutex_);
  uint64_t bytes = 0;
  for (const auto& [step, image] : captured_) bytes += image.bytes();
  return bytes;
}

absl::Status FakeClusterStore::JournalRoomFor(const NodeImage& own, int own_position,
                                              const std::vector<std::string>& group_images,
                                              uint64_t stripes) const {
  const absl::StatusOr<uint64_t> bound =
      CommitJournalBound(own, own_position, group_images, stripes);
  if (!bound.ok()) return bound.status();
  absl::MutexLock lock(&mutex_);
  if (!journal_bytes_ || *bound <= *journal_bytes_) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("a journal state of ", *bound,
                                                   " bytes does not fit: raise pool.journal_bytes"));
}

void FakeClusterStore::SetJournalBytes(std::optional<uint64_t> bytes) {
  absl::MutexLock lock(&mutex_);
  journal_bytes_ = bytes;
}

void FakeClusterStore::SplitState(int regions) {
  absl::MutexLock lock(&mutex_);
  state_regions_ = regions;
}

void FakeClusterStore::RecaptureOnly(std::function<bool(int, int64_t)> recaptured) {
  absl::MutexLock lock(&mutex_);
  recaptured_ = std::move(recaptured);
}

std::vector<uint8_t> FakeClusterStore::WrittenOf(uint32_t rank, const std::string& region) const {
  absl::MutexLock lock(&mutex_);
  auto it = written_.find({rank, region});
  return it == written_.end() ? std::vector<uint8_t>() : it->second.bytes;
}

int FakeClusterStore::WritesOf(uint32_t rank, const std::string& region) const {
  absl::MutexLock lock(&mutex_);
  auto it = written_.find({rank, region});
  return it == written_.end() ? 0 : it->second.writes;
}

void FakeClusterStore::BeforeWrite(std::function<void()> hook) {
  absl::MutexLock lock(&mutex_);
  before_write_ = std::move(hook);
}

// As the store does: each chunk is checked against its stored CRC-32C, and a region that fails is
// not kept.
absl::Status FakeClusterStore::WriteRegion(uint32_t rank, const v1::ImageRegion& stored,
                                           const PoolBytes& bytes) {
  std::function<void()> hook;
  {
    absl::MutexLock lock(&mutex_);
    hook = before_write_;
  }
  if (hook) hook();
  if (bytes.bytes() != stored.bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(bytes.bytes(), " bytes for region '",
                                                   stored.region(), "' of ", stored.bytes()));
  }
  if (stored.chunk_bytes() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("region '", stored.region(), "' has no chunks"));
  }
  std::vector<uint8_t> copy(stored.bytes());
  bytes.Read(0, copy.size(), copy.data());
  for (uint64_t chunk = 0; chunk * stored.chunk_bytes() < copy.size(); ++chunk) {
    const uint64_t start = chunk * stored.chunk_bytes();
    const uint64_t length = std::min<uint64_t>(stored.chunk_bytes(), copy.size() - start);
    if (chunk >= static_cast<uint64_t>(stored.chunk_crcs_size()) ||
        erasure::Crc32c(copy.data() + start, length) != stored.chunk_crcs(chunk)) {
      return absl::DataLossError(
          absl::StrCat("chunk ", chunk, " of region '", stored.region(), "' is damaged"));
    }
  }
  absl::MutexLock lock(&mutex_);
  Written& written = written_[{rank, stored.region()}];
  written.bytes = std::move(copy);
  ++written.writes;
  return absl::OkStatus();
}

absl::StatusOr<v1::RestoreResponse> FakeClusterStore::RestoreFromRank(
    uint32_t, uint32_t source_rank, const std::vector<std::string>&) {
  return absl::NotFoundError(absl::StrCat("rank ", source_rank, " is not here"));
}

v1::VerifyResponse FakeClusterStore::Verify(std::optional<int64_t>) const {
  absl::MutexLock lock(&mutex_);
  v1::VerifyResponse response;
  for (const auto& [region, chunk] : committed_.CorruptChunks()) {
    v1::VerifyResponse::Corruption* corruption = response.add_corruptions();
    corruption->set_rank(committed_.manifest().regions(region).rank());
    corruption->set_region(committed_.manifest().regions(region).region());
    corruption->set_chunk(chunk);
  }
  return response;
}

// --- FakeDecisionLog ------------------------------------------------------------------------------

void FakeDecisionLog::Listen(uint32_t node, Listener listener) {
  absl::MutexLock lock(&mutex_);
  listeners_[node] = std::move(listener);
}

void FakeDecisionLog::Deafen(uint32_t node) {
  absl::MutexLock lock(&mutex_);
  deaf_.insert(node);
}

void FakeDecisionLog::Hear(uint32_t node) {
  absl::MutexLock lock(&mutex_);
  deaf_.erase(node);
}

void FakeDecisionLog::SetLeaderToken(int64_t token) {
  absl::MutexLock lock(&mutex_);
  leader_token_ = token;
}

void FakeDecisionLog::SetReachable(bool reachable) {
  absl::MutexLock lock(&mutex_);
  reachable_ = reachable;
}

void FakeDecisionLog::CutOff(uint32_t node, bool cut) {
  absl::MutexLock lock(&mutex_);
  if (cut) {
    cut_off_.insert(node);
  } else {
    cut_off_.erase(node);
  }
}

DecisionLog* FakeDecisionLog::ViewOf(uint32_t node) {
  absl::MutexLock lock(&mutex_);
  std::unique_ptr<NodeView>& view = views_[node];
  if (view == nullptr) view = std::make_unique<NodeView>(this, node);
  return view.get();
}

absl::Status FakeDecisionLog::NodeView::Reach() const {
  absl::MutexLock lock(&log_->mutex_);
  if (log_->cut_off_.contains(node_)) {
    return absl::UnavailableError(absl::StrCat("node ", node_, " cannot reach the decision log"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::StepDecision> FakeDecisionLog::NodeView::Decide(
    const v1::StepDecision& decision) {
  if (absl::Status reached = Reach(); !reached.ok()) return reached;
  return log_->Decide(decision);
}

absl::StatusOr<std::vector<v1::StepDecision>> FakeDecisionLog::NodeView::DecisionsAfter(
    std::optional<int64_t> after) {
  if (absl::Status reached = Reach(); !reached.ok()) return reached;
  return log_->DecisionsAfter(after);
}

absl::Status FakeDecisionLog::NodeView::ForgetBefore(int64_t step, int64_t token) {
  if (absl::Status reached = Reach(); !reached.ok()) return reached;
  return log_->ForgetBefore(step, token);
}

void FakeDecisionLog::BeforeDecide(std::function<void(const v1::StepDecision&)> hook) {
  absl::MutexLock lock(&mutex_);
  before_decide_ = std::move(hook);
}

std::map<int64_t, v1::StepDecision> FakeDecisionLog::decisions() const {
  absl::MutexLock lock(&mutex_);
  return decisions_;
}

int FakeDecisionLog::writes() const {
  absl::MutexLock lock(&mutex_);
  return writes_;
}

absl::StatusOr<v1::StepDecision> FakeDecisionLog::Decide(const v1::StepDecision& decision) {
  std::function<void(const v1::StepDecision&)> hook;
  {
    absl::MutexLock lock(&mutex_);
    hook = before_decide_;
  }
  if (hook) hook(decision);
  std::vector<Listener> listeners;
  {
    absl::MutexLock lock(&mutex_);
    if (!reachable_) return absl::UnavailableError("the decision log cannot be reached");
    if (auto it = decisions_.find(decision.step()); it != decisions_.end()) return it->second;
    if (decision.token() != leader_token_) {
      return absl::FailedPreconditionError(absl::StrCat("token ", decision.token(),
                                                        " no longer leads (", leader_token_, " does)"));
    }
    decisions_[decision.step()] = decision;
    ++writes_;
    for (const auto& [node, listener] : listeners_) {
      if (!deaf_.contains(node) && !cut_off_.contains(node)) listeners.push_back(listener);
    }
  }
  // Delivered as a watch would, outside the log's lock (a listener may read the log).
  for (const Listener& listener : listeners) listener(decision);
  return decision;
}

absl::StatusOr<std::vector<v1::StepDecision>> FakeDecisionLog::DecisionsAfter(
    std::optional<int64_t> after) {
  absl::MutexLock lock(&mutex_);
  if (!reachable_) return absl::UnavailableError("the decision log cannot be reached");
  std::vector<v1::StepDecision> decisions;
  for (auto it = after ? decisions_.upper_bound(*after) : decisions_.begin();
       it != decisions_.end(); ++it) {
    decisions.push_back(it->second);
  }
  return decisions;
}

absl::Status FakeDecisionLog::ForgetBefore(int64_t step, int64_t token) {
  absl::MutexLock lock(&mutex_);
  if (!reachable_) return absl::UnavailableError("the decision log cannot be reached");
  if (token != leader_token_) return absl::FailedPreconditionError("deposed");
  decisions_.erase(decisions_.begin(), decisions_.lower_bound(step));
  ++writes_;
  return absl::OkStatus();
}

// --- FakeElection ---------------------------------------------------------------------------------

int64_t FakeElection::Elect(uint32_t node) {
  int64_t token = 0;
  {
    absl::MutexLock lock(&mutex_);
    leader_ = node;
    token = token_ += 10;
    changed_.SignalAll();
  }
  log_->SetLeaderToken(token);
  nodes_->SetLeader(LeaderView{node, token});
  return token;
}

void FakeElection::Depose() {
  {
    absl::MutexLock lock(&mutex_);
    leader_.reset();
    changed_.SignalAll();
  }
  log_->SetLeaderToken(0);
  nodes_->SetLeader(std::nullopt);
}

std::optional<std::pair<uint32_t, int64_t>> FakeElection::leader() const {
  absl::MutexLock lock(&mutex_);
  if (!leader_) return std::nullopt;
  return std::pair<uint32_t, int64_t>(*leader_, token_);
}

absl::StatusOr<int64_t> FakeElection::Candidate::Campaign(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&election_->mutex_);
  while (election_->leader_ != node_) {
    if (election_->changed_.WaitWithDeadline(&election_->mutex_, deadline)) {
      return absl::DeadlineExceededError("another node leads");
    }
  }
  return election_->token_;
}

bool FakeElection::Candidate::Holds(int64_t token) const {
  absl::MutexLock lock(&election_->mutex_);
  return election_->leader_ == node_ && election_->token_ == token;
}

void FakeElection::Candidate::Resign(int64_t) {}

// --- FakeNetwork and FakePeerClient ---------------------------------------------------------------

void FakeNetwork::Attach(uint32_t node, NodeUnits* units) {
  absl::MutexLock lock(&mutex_);
  nodes_[node] = units;
}

void FakeNetwork::Detach(uint32_t node) {
  absl::MutexLock lock(&mutex_);
  nodes_.erase(node);
}

void FakeNetwork::Cut(uint32_t node) {
  absl::MutexLock lock(&mutex_);
  cut_.insert(node);
}

void FakeNetwork::Heal(uint32_t node) {
  absl::MutexLock lock(&mutex_);
  cut_.erase(node);
}

void FakeNetwork::SetFilter(
    std::function<absl::Status(uint32_t, uint32_t, const std::string&)> filter) {
  absl::MutexLock lock(&mutex_);
  filter_ = std::move(filter);
}

void FakeNetwork::SetUnitsServed(std::function<void(uint32_t, uint32_t)> hook) {
  absl::MutexLock lock(&mutex_);
  units_served_ = std::move(hook);
}

void FakeNetwork::UnitsServed(uint32_t from, uint32_t to) {
  std::function<void(uint32_t, uint32_t)> hook;
  {
    absl::MutexLock lock(&mutex_);
    hook = units_served_;
  }
  if (hook) hook(from, to);
}

void FakeNetwork::SetEncodeRewrite(EncodeRewrite rewrite) {
  absl::MutexLock lock(&mutex_);
  encode_rewrite_ = std::move(rewrite);
}

v1::EncodeRequest FakeNetwork::Rewritten(uint32_t from, uint32_t to,
                                         const v1::EncodeRequest& request) {
  EncodeRewrite rewrite;
  {
    absl::MutexLock lock(&mutex_);
    rewrite = encode_rewrite_;
  }
  v1::EncodeRequest rewritten = request;
  if (rewrite) rewrite(from, to, rewritten);
  return rewritten;
}

void FakeNetwork::SetPrepareAnswerRewrite(PrepareAnswerRewrite rewrite) {
  absl::MutexLock lock(&mutex_);
  prepare_answer_rewrite_ = std::move(rewrite);
}

void FakeNetwork::RewriteAnswer(uint32_t from, uint32_t to, v1::PrepareResponse& response) {
  PrepareAnswerRewrite rewrite;
  {
    absl::MutexLock lock(&mutex_);
    rewrite = prepare_answer_rewrite_;
  }
  if (rewrite) rewrite(from, to, response);
}

void FakeNetwork::Proposed(const v1::ProposeRequest& request) {
  absl::MutexLock lock(&mutex_);
  proposals_.push_back(request);
}

std::vector<v1::ProposeRequest> FakeNetwork::proposals() const {
  absl::MutexLock lock(&mutex_);
  return proposals_;
}

absl::StatusOr<NodeUnits*> FakeNetwork::Route(uint32_t from, uint32_t to, const std::string& name) {
  std::function<absl::Status(uint32_t, uint32_t, const std::string&)> filter;
  {
    absl::MutexLock lock(&mutex_);
    if (cut_.contains(from) || cut_.contains(to)) {
      return absl::UnavailableError(absl::StrCat(name, " to node ", to, ": cut off"));
    }
    auto it = nodes_.find(to);
    if (it == nodes_.end()) {
      return absl::UnavailableError(absl::StrCat(name, " to node ", to, ": no such node"));
    }
    filter = filter_;
    if (!filter) return it->second;
  }
  if (absl::Status status = filter(from, to, name); !status.ok()) return status;
  absl::MutexLock lock(&mutex_);
  auto it = nodes_.find(to);
  if (it == nodes_.end()) return absl::UnavailableError("gone");
  return it->second;
}

absl::StatusOr<v1::NodeReport> FakePeerClient::Describe(uint32_t node) {
  ++calls_;
  absl::StatusOr<NodeUnits*> to = network_->Route(self_, node, "Describe");
  if (!to.ok()) return to.status();
  return (*to)->report.Describe();
}

absl::StatusOr<v1::ProposeResponse> FakePeerClient::Propose(uint32_t node,
                                                            const v1::ProposeRequest& request) {
  ++calls_;
  absl::StatusOr<NodeUnits*> to = network_->Route(self_, node, "Propose");
  if (!to.ok()) return to.status();
  absl::StatusOr<v1::ProposeResponse> response = (*to)->coordinator.Propose(request);
  if (response.ok()) network_->Proposed(request);
  return response;
}

absl::StatusOr<v1::PrepareResponse> FakePeerClient::Prepare(uint32_t node,
                                                            const v1::PrepareRequest& request) {
  ++calls_;
  absl::StatusOr<NodeUnits*> to = network_->Route(self_, node, "Prepare");
  if (!to.ok()) return to.status();
  absl::StatusOr<v1::PrepareResponse> response = (*to)->participant.Prepare(request);
  if (response.ok()) network_->RewriteAnswer(self_, node, *response);
  return response;
}

absl::StatusOr<v1::EncodeResponse> FakePeerClient::Encode(uint32_t node,
                                                          const v1::EncodeRequest& request) {
  ++calls_;
  absl::StatusOr<NodeUnits*> to = network_->Route(self_, node, "Encode");
  if (!to.ok()) return to.status();
  return (*to)->participant.Encode(network_->Rewritten(self_, node, request));
}

absl::StatusOr<v1::GroupStateResponse> FakePeerClient::GroupState(uint32_t node) {
  ++calls_;
  absl::StatusOr<NodeUnits*> to = network_->Route(self_, node, "GroupState");
  if (!to.ok()) return to.status();
  return (*to)->rebuilder.GroupState();
}

absl::StatusOr<v1::SendUnitsResponse> FakePeerClient::SendUnits(
    uint32_t node, const v1::SendUnitsRequest& request) {
  ++calls_;
  absl::StatusOr<NodeUnits*> to = network_->Route(self_, node, "SendUnits");
  if (!to.ok()) return to.status();
  absl::StatusOr<v1::SendUnitsResponse> served = (*to)->transfer.ServeUnits(request);
  network_->UnitsServed(self_, node);
  return served;
}

absl::StatusOr<v1::DecodeUnitsResponse> FakePeerClient::DecodeUnits(
    uint32_t node, const v1::DecodeUnitsRequest& request) {
  ++calls_;
  absl::StatusOr<NodeUnits*> to = network_->Route(self_, node, "DecodeUnits");
  if (!to.ok()) return to.status();
  absl::StatusOr<v1::DecodeUnitsResponse> served =
      (*to)->rebuilder.DecodeFor(request, [] { return false; });
  network_->UnitsServed(self_, node);
  return served;
}

absl::StatusOr<v1::RebuildResponse> FakePeerClient::Rebuild(uint32_t node) {
  ++calls_;
  absl::StatusOr<NodeUnits*> to = network_->Route(self_, node, "Rebuild");
  if (!to.ok()) return to.status();
  return (*to)->rebuilder.RebuildHere();
}

absl::StatusOr<v1::LocateRankResponse> FakePeerClient::LocateRank(uint32_t,
                                                                  const v1::LocateRankRequest&) {
  return absl::UnimplementedError("not in these tests");
}

absl::StatusOr<v1::FetchLogResponse> FakePeerClient::FetchLog(uint32_t, const v1::FetchLogRequest&) {
  return absl::UnimplementedError("not in these tests");
}

absl::StatusOr<v1::DurableStateResponse> FakePeerClient::DurableState(uint32_t, absl::Time) {
  return absl::UnimplementedError("not in these tests");
}

// --- NodeUnits and InProcessCluster ---------------------------------------------------------------

namespace {

std::unique_ptr<Pool> TestPool(const std::string& name) {
  std::filesystem::remove("/dev/shm/" + name + ".data");
  absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(
      {.name = name, .bytes = kTestPoolBytes, .lock = PoolLockMode::kOff, .journal_bytes = 1 << 20});
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? *std::move(pool) : nullptr;
}

std::string PoolName(uint32_t id) {
  static std::atomic<int> counter{0};
  return absl::StrCat("moesnap-cluster-unit-", getpid(), "-", id, "-", counter++);
}

}  // namespace

NodeUnits::NodeUnits(uint32_t node_id, const Topology* topology, NodeTable* nodes,
                     FakeNetwork* network, FakeDecisionLog* log, FakeElection* election,
                     FakeDurableRecords* records)
    : id(node_id),
      pool_name(PoolName(node_id)),
      pool(TestPool(pool_name)),
      peers(node_id, network),
      context{.topology = topology, .nodes = nodes, .peers = &peers, .tls = nullptr},
      store(pool.get(), node_id),
      parity(pool.get(), topology->codec.get(), &topology->layout, topology->position,
             absl::Seconds(5)),
      transfer(context, &store, &parity),
      rebuilder(context, &store, &parity, &transfer, pool.get(), log->ViewOf(node_id),
                {.retry_interval = absl::Milliseconds(20),
                 .max_retry_interval = absl::Milliseconds(200),
                 .hold_install_steps = std::nullopt,
                 .helper_request_bytes = kHelperRequestBytes}),
      participant(context, &store, &parity, &transfer, &rebuilder, log->ViewOf(node_id)),
      candidate(election, node_id),
      coordinator(context, &candidate, log->ViewOf(node_id), &store, records,
                  {.forget_every = 4, .campaign_wait = absl::Milliseconds(50)}),
      remote_restore(context, &store, &transfer, &rebuilder),
      report(context, &store, &parity, pool.get(), &rebuilder, &participant, &remote_restore) {}

NodeUnits::~NodeUnits() {
  std::filesystem::remove("/dev/shm/" + pool_name + ".data");
}

void NodeUnits::Start() {
  rebuilder.Start();
  participant.Start();
  coordinator.Start();
}

InProcessCluster::InProcessCluster(int nodes, int data_units, int parity_units,
                                   bool allow_degraded, uint64_t stripe_unit_bytes)
    : table_(nodes), log_(), election_(&log_, &table_) {
  ClusterOptions options;
  options.allow_degraded = allow_degraded;
  options.job = "unit";
  options.node_count = nodes;
  options.data_units = data_units;
  options.parity_units = parity_units;
  options.stripe_unit_bytes = stripe_unit_bytes;
  options.commit_timeout_ms = kCommitTimeoutMs;
  options.advertise_host = "127.0.0.1";
  options.tls.insecure = true;  // units in one process, over loopback
  absl::StatusOr<std::unique_ptr<const Topology>> topology =
      Topology::Create(0, options, kTestPoolBytes);
  EXPECT_TRUE(topology.ok()) << topology.status();
  topology_ = *std::move(topology);
  for (int id = 0; id < nodes; ++id) Replace(id);
}

InProcessCluster::~InProcessCluster() {
  // A round still running while the nodes go decides into the log: no node hears it any more.
  for (auto& [id, units] : nodes_) {
    network_.Detach(id);
    log_.Deafen(id);
  }
  nodes_.clear();
}

void InProcessCluster::Replace(uint32_t id, const std::function<uint16_t(uint16_t)>& reached_at) {
  network_.Detach(id);
  table_.Remove(id);
  nodes_.erase(id);
  // Each node's topology differs only in who it is.
  ClusterOptions options = topology_->options;
  absl::StatusOr<std::unique_ptr<const Topology>> topology =
      Topology::Create(id, options, kTestPoolBytes);
  ASSERT_TRUE(topology.ok()) << topology.status();
  topologies_.push_back(*std::move(topology));
  auto units = std::make_unique<NodeUnits>(id, topologies_.back().get(), &table_, &network_, &log_,
                                           &election_, &records_);
  absl::StatusOr<uint16_t> port = units->transfer.Start("127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  NodeUnits* raw = units.get();
  log_.Listen(id, [raw](const v1::StepDecision& decision) { raw->participant.Apply(decision); });
  // A fresh daemon: reachable, and its watch hears every decision (whatever happened to the lost one).
  log_.Hear(id);
  network_.Heal(id);
  network_.Attach(id, raw);
  table_.Set({.id = id, .address = {id, "127.0.0.1", 1, reached_at ? reached_at(*port) : *port},
              .hostname = "test",
              .incarnation = static_cast<int64_t>(topologies_.size())});
  nodes_[id] = std::move(units);
  raw->Start();
}

void InProcessCluster::Lose(uint32_t id) {
  log_.Deafen(id);
  network_.Cut(id);
  table_.Remove(id);
}

void InProcessCluster::CaptureEverywhere(int64_t step, uint64_t bytes, uint64_t kept_bytes) {
  for (auto& [id, units] : nodes_) units->store.Capture(step, bytes, {}, kept_bytes);
}

bool InProcessCluster::WaitCommitted(int64_t step, std::vector<uint32_t> nodes) {
  if (nodes.empty()) {
    for (const auto& [id, units] : nodes_) nodes.push_back(id);
  }
  const absl::Time deadline = absl::Now() + kWait;
  for (uint32_t id : nodes) {
    while (node(id).participant.CommittedStep() != step) {
      if (absl::Now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  return true;
}

std::optional<v1::StepDecision> InProcessCluster::WaitDecided(int64_t step) {
  const absl::Time deadline = absl::Now() + kWait;
  while (absl::Now() < deadline) {
    const std::map<int64_t, v1::StepDecision> decisions = log_.decisions();
    if (auto it = decisions.find(step); it != decisions.end()) return it->second;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return std::nullopt;
}

bool InProcessCluster::WaitLogWrites(int writes) {
  const absl::Time deadline = absl::Now() + kWait;
  while (log_.writes() < writes && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return log_.writes() >= writes;
}

void InProcessCluster::ExpectEveryNodeRebuildable(int64_t step, uint64_t bytes) {
  for (auto& [id, units] : nodes_) {
    // What the node captured at `step`; a replacement, which captured nothing, holds what the
    // node it replaced captured (with no region kept).
    std::vector<uint8_t> captured = units->store.CapturedStateOf(step);
    if (captured.empty()) captured = StateOf(id, step, bytes, 0);
    absl::StatusOr<v1::RebuildResponse> rebuilt = units->rebuilder.RebuildHere();
    ASSERT_TRUE(rebuilt.ok()) << "node " << id << ": " << rebuilt.status();
    EXPECT_EQ(rebuilt->step(), step) << "node " << id;
    EXPECT_TRUE(units->store.CommittedBytesOf() == captured)
        << "node " << id << "'s data decoded from its group differs from what it captured";
  }
}

}  // namespace moesnap::daemon::cluster::testing
