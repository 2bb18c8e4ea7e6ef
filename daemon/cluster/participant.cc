// Participant: proposing captured steps, and the node's side of prepare, encode, commit, abort.
#include "daemon/cluster/participant.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace moesnap::daemon::cluster {
namespace {

// How often the proposer looks up from waiting for captures to see whether it should stop.
constexpr absl::Duration kProposerWake = absl::Milliseconds(100);

}  // namespace

Participant::Participant(const ClusterContext& context, ClusterStore* store, ParityStore* parity,
                         Transfer* transfer, const Rebuilder* rebuilder,
                         const Membership* membership)
    : context_(context), store_(store), parity_(parity), transfer_(transfer),
      rebuilder_(rebuilder), membership_(membership) {}

Participant::~Participant() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    changed_.SignalAll();
  }
  if (proposer_.joinable()) proposer_.join();
}

void Participant::Start() {
  proposer_ = std::thread([this] { ProposeLoop(); });
}

bool Participant::stopping() const {
  absl::MutexLock lock(&mutex_);
  return stopping_;
}

void Participant::ProposeLoop() {
  std::optional<int64_t> last;
  while (!stopping()) {
    absl::StatusOr<int64_t> step = store_->WaitNodeCapturedAfter(last, absl::Now() + kProposerWake);
    if (!step.ok()) continue;
    last = *step;
    Propose(*step);
  }
}

void Participant::Propose(int64_t step) {
  // Retried while the coordinator changes or is unreachable; the commit timeout bounds it.
  const absl::Time give_up = absl::Now() + absl::Milliseconds(context_.options().commit_timeout_ms);
  while (absl::Now() < give_up) {
    v1::ProposeRequest request;
    request.set_from_node(context_.node_id());
    request.set_step(step);
    absl::StatusOr<v1::ProposeResponse> response =
        context_.peers->Propose(membership_->Coordinator(), request);
    if (response.ok()) {
      if (response->decided()) {
        // Captured after the cluster's round of the step ended (a replacement replaying it, or
        // a capture slower than the commit timeout): no round will take it, so end it here.
        store_->AbortNodeStep(step, absl::AbortedError(absl::StrCat(
                                        "the cluster decided step ", step,
                                        " before this node captured it")));
      }
      return;
    }
    absl::MutexLock lock(&mutex_);
    changed_.WaitWithTimeout(&mutex_, HeartbeatInterval(context_.options()));
    if (stopping_) return;
  }
}

absl::StatusOr<v1::PrepareResponse> Participant::Prepare(const v1::PrepareRequest& request) {
  if (absl::Status status = membership_->CheckCoordinator(request.coordinator()); !status.ok()) {
    return status;
  }
  if (rebuilder_->behind()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", context_.node_id(),
        " does not hold its data of the latest committed step (rebuilding or unrecoverable)"));
  }
  absl::StatusOr<NodeImage> image = store_->WaitNodeCaptured(
      request.step(), absl::Now() + absl::Milliseconds(request.timeout_ms()));
  if (!image.ok()) return image.status();
  v1::PrepareResponse response;
  *response.mutable_image() = image->manifest();
  if (const v1::JournalCluster committed = store_->ClusterRecord(); committed.has_committed_step()) {
    response.set_committed_step(committed.committed_step());
  }
  response.mutable_image()->set_node_id(context_.node_id());
  absl::MutexLock lock(&mutex_);
  OpenStep& open = open_[request.step()];
  open.coordinator = request.coordinator();
  open.image = *std::move(image);
  return response;
}

absl::StatusOr<v1::EncodeResponse> Participant::Encode(const v1::EncodeRequest& request) {
  const erasure::StripeLayout& layout = context_.layout();
  const Topology& topology = *context_.topology;
  const int64_t step = request.step();
  if (request.group_images_size() != layout.group_size()) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step, ": ",
                                                   request.group_images_size(),
                                                   " images for a group of ", layout.group_size()));
  }
  NodeImage image;
  {
    absl::MutexLock lock(&mutex_);
    auto it = open_.find(step);
    if (it == open_.end() || it->second.coordinator != request.coordinator()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step, " was not prepared here by node ", request.coordinator()));
    }
    image = it->second.image;
  }
  std::vector<uint64_t> image_bytes;
  for (int position = 0; position < layout.group_size(); ++position) {
    const v1::NodeImage& member = request.group_images(position);
    if (member.node_id() != topology.NodeAt(position)) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step, ": image ", position,
                                                     " is node ", member.node_id(),
                                                     "'s, not node ", topology.NodeAt(position),
                                                     "'s"));
    }
    image_bytes.push_back(member.bytes());
  }
  if (image_bytes[topology.position] != image.bytes()) {
    return absl::InvalidArgumentError("this node's image size differs");
  }
  // A step that keeps every node's layout updates the committed parity with the deltas of the
  // units it changed; anything else (the first step, a rank registering new regions) encodes whole.
  // Every node of the group decides the same from the same two records, unless the coordinator
  // found that the group's nodes do not hold the same committed step.
  const v1::JournalCluster committed = store_->ClusterRecord();
  bool delta = !request.whole() && committed.has_committed_step() &&
               committed.group_images_size() == layout.group_size();
  for (int position = 0; delta && position < layout.group_size(); ++position) {
    delta = SameLayout(committed.group_images(position), request.group_images(position));
  }
  std::vector<std::vector<bool>> changed;
  if (delta) {
    for (int position = 0; position < layout.group_size(); ++position) {
      changed.push_back(ChangedUnits(committed.group_images(position),
                                     request.group_images(position), layout.unit_bytes()));
    }
  }
  if (absl::Status status = parity_->Begin(step, image_bytes, delta ? &changed : nullptr);
      !status.ok()) {
    return status;
  }
  const absl::Time deadline = absl::Now() + absl::Milliseconds(request.timeout_ms());
  absl::StatusOr<uint64_t> sent = transfer_->SendDataUnits(
      step, image, delta ? std::optional<NodeImage>(store_->CommittedImage()) : std::nullopt,
      delta ? &changed[topology.position] : nullptr);
  absl::Status status = sent.status();
  if (status.ok()) status = parity_->WaitComplete(step, deadline);
  if (!status.ok()) {
    parity_->Abort(step);
    return status;
  }
  (delta ? delta_encodes_ : full_encodes_)++;
  parity_bytes_sent_ += *sent;
  v1::EncodeResponse response;
  response.set_bytes_sent(*sent);
  response.set_delta(delta);
  response.set_parity_bytes(parity_->in_flight_bytes());
  absl::MutexLock lock(&mutex_);
  OpenStep& open = open_[step];
  open.group_images.assign(request.group_images().begin(), request.group_images().end());
  open.encoded = true;
  return response;
}

absl::Status Participant::Commit(const v1::CommitRequest& request) {
  const int64_t step = request.step();
  const v1::JournalCluster current = store_->ClusterRecord();
  if (current.has_committed_step() && current.committed_step() == step) {
    return absl::OkStatus();  // a new coordinator finishing the step
  }
  OpenStep open;
  {
    absl::MutexLock lock(&mutex_);
    auto it = open_.find(step);
    if (it == open_.end() || !it->second.encoded) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step, " is not encoded on node ", context_.node_id()));
    }
    // A commit is sent only once the step is decided (every node encoded it), so it is accepted
    // from whichever coordinator finishes the step.
    open = it->second;
  }
  v1::JournalCluster record;
  record.set_committed_step(step);
  for (const v1::NodeImage& image : open.group_images) *record.add_group_images() = image;
  for (v1::JournalParity& parity : parity_->Records(step)) *record.add_parity() = std::move(parity);
  if (absl::Status status = store_->CommitNodeStep(step, record); !status.ok()) return status;
  parity_->Commit(step);
  absl::MutexLock lock(&mutex_);
  open_.erase(open_.begin(), open_.upper_bound(step));
  return absl::OkStatus();
}

absl::Status Participant::Abort(const v1::AbortRequest& request) {
  const int64_t step = request.step();
  const v1::JournalCluster current = store_->ClusterRecord();
  if (current.has_committed_step() && current.committed_step() == step) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is already committed on node ", context_.node_id()));
  }
  {
    // An abort can race its coordinator's commit only if it comes from elsewhere while that
    // coordinator lives: refused then.
    absl::MutexLock lock(&mutex_);
    auto it = open_.find(step);
    if (it != open_.end() && it->second.coordinator != request.coordinator() &&
        context_.nodes->Live(it->second.coordinator)) {
      return absl::FailedPreconditionError(absl::StrCat("step ", step, " belongs to coordinator ",
                                                        it->second.coordinator, ", which is live"));
    }
  }
  store_->AbortNodeStep(step, absl::AbortedError(absl::StrCat(
                                  "the cluster aborted step ", step, ": ", request.reason())));
  parity_->Abort(step);
  absl::MutexLock lock(&mutex_);
  open_.erase(step);
  last_abort_ = absl::StrCat("step ", step, ": ", request.reason());
  return absl::OkStatus();
}

v1::StepOutcomeResponse Participant::StepOutcome(const v1::StepOutcomeRequest& request) const {
  v1::StepOutcomeResponse response;
  const v1::JournalCluster current = store_->ClusterRecord();
  if (current.has_committed_step() && current.committed_step() == request.step()) {
    response.set_state(v1::STEP_STATE_COMMITTED);
    return response;
  }
  absl::MutexLock lock(&mutex_);
  auto it = open_.find(request.step());
  if (it != open_.end()) {
    response.set_state(it->second.encoded ? v1::STEP_STATE_ENCODED : v1::STEP_STATE_CAPTURED);
  }
  return response;
}

std::vector<OpenStepView> Participant::OpenSteps() const {
  absl::MutexLock lock(&mutex_);
  std::vector<OpenStepView> views;
  for (const auto& [step, open] : open_) views.push_back({step, open.coordinator, open.encoded});
  return views;
}

std::string Participant::last_abort() const {
  absl::MutexLock lock(&mutex_);
  return last_abort_;
}

}  // namespace moesnap::daemon::cluster
