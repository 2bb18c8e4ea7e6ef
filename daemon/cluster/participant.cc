// Participant: proposing captured steps, prepare and encode under a fencing token, and applying
// the decisions etcd holds.
#include "daemon/cluster/participant.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "daemon/cluster/image_patch.h"
#include "daemon/cluster/peer_checks.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon::cluster {
namespace {

// How often the proposer looks up from waiting for captures (a new leader, stopping).
constexpr absl::Duration kProposerWake = absl::Milliseconds(100);
// How long Encode waits for this node to apply the decision of its base step, after a read of the
// log did not bring it (the watch may deliver it a moment later).
constexpr absl::Duration kBaseWait = absl::Seconds(2);

}  // namespace

// A coordinator asks for no longer than the job's commit timeout; a longer wait is cut to it.
absl::Duration Participant::CappedWait(uint32_t timeout_ms) const {
  return absl::Milliseconds(std::min(timeout_ms, context_.options().commit_timeout_ms));
}

namespace {

std::string StepText(const std::optional<int64_t>& step) {
  return step ? absl::StrCat("step ", *step) : "no step";
}

}  // namespace

Participant::Participant(const ClusterContext& context, ClusterStore* store, ParityStore* parity,
                         Transfer* transfer, Rebuilder* rebuilder, DecisionLog* log)
    : context_(context), store_(store), parity_(parity), transfer_(transfer),
      rebuilder_(rebuilder), log_(log) {}

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

std::optional<int64_t> Participant::CommittedStep() const {
  const std::shared_ptr<const v1::JournalCluster> record = store_->ClusterRecord();
  if (!record->has_committed_step()) return std::nullopt;
  return record->committed_step();
}

bool Participant::DecidedLocked(int64_t step, const std::optional<int64_t>& committed) const {
  return (committed && step <= *committed) || decided_.contains(step);
}

void Participant::ProposeLoop() {
  std::set<int64_t> undecided;             // captured here, no decision seen
  std::map<int64_t, int64_t> proposed_to;  // step -> the leader token it was proposed under
  while (!stopping()) {
    // Every capture, a step captured again after its decision included (it is dropped below).
    absl::StatusOr<int64_t> captured = store_->WaitNewNodeCapture(absl::Now() + kProposerWake);
    if (captured.ok()) undecided.insert(*captured);
    const std::optional<LeaderView> leader = context_.nodes->Leader();
    const std::optional<int64_t> committed = CommittedStep();
    for (auto it = undecided.begin(); it != undecided.end();) {
      const int64_t step = *it;
      std::optional<bool> decision;
      {
        absl::MutexLock lock(&mutex_);
        if (committed && step <= *committed) {
          decision = step == *committed;
        } else if (auto found = decided_.find(step); found != decided_.end()) {
          decision = found->second;
        }
      }
      if (decision) {
        // Aborted, or passed over by a later commit: a capture of it that ended after the decision
        // (a replacement replaying it, or one slower than the commit timeout) is dropped here.
        if (!*decision) {
          store_->AbortNodeStep(step, absl::AbortedError(absl::StrCat(
                                          "the cluster decided step ", step,
                                          " before this node captured it")));
        } else if (const std::optional<int64_t> replaced = rebuilder_->replaced_through();
                   replaced && step <= *replaced && (!committed || *committed < step)) {
          // The job went back to a durable step and trains this step again; its number was
          // committed by the run it went back from, and a decision is never written twice.
          store_->AbortNodeStep(step, absl::AbortedError(absl::StrCat(
                                          "step ", step, " was committed before the job went "
                                          "back to the durable tier; the steps after it are "
                                          "snapshotted again")));
        }
        proposed_to.erase(step);
        it = undecided.erase(it);
        continue;
      }
      ++it;
    }
    if (!leader) continue;
    // Proposed once per leader, so that a new coordinator learns of it; its decision comes from
    // etcd whatever the answer says. Only a step with none before it undecided comes with its
    // image: the image holds the step's bytes until the decision, and a step captured before the
    // one ahead was decided is built on a committed step that is not the round's base anyway.
    for (const int64_t step : undecided) {
      if (proposed_to[step] == leader->token) continue;
      v1::ProposeRequest request;
      request.set_from_node(context_.node_id());
      request.set_step(step);
      if (undecided.size() == 1) OpenProposed(step, *leader, request);
      if (!request.has_image()) request.set_token(OpenTokenOf(step));
      if (context_.peers->Propose(leader->node_id, request).ok()) {
        proposed_to[step] = leader->token;
      }
    }
  }
}

absl::Status Participant::Fence(int64_t token, uint32_t coordinator) {
  // A coordinator's token is its leader key's create revision in etcd. One newer than the leader
  // this node knows is waited for (its watch may lag the election by a moment), then refused.
  const absl::Time until = absl::Now() + kBaseWait;
  std::optional<LeaderView> leader = context_.nodes->Leader();
  while ((!leader || leader->token < token) && absl::Now() < until) {
    const uint64_t seen = context_.nodes->version();
    leader = context_.nodes->Leader();
    if (leader && leader->token >= token) break;
    context_.nodes->WaitChange(seen, until);
    leader = context_.nodes->Leader();
  }
  if (!leader || leader->token < token ||
      (leader->token == token && leader->node_id != coordinator)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", context_.node_id(), " refuses node ", coordinator, "'s call under token ", token,
        ": etcd names ",
        leader ? absl::StrCat("node ", leader->node_id, " as coordinator with token ", leader->token)
               : "no coordinator"));
  }
  absl::MutexLock lock(&mutex_);
  if (leader && leader->token > highest_token_) {
    highest_token_ = leader->token;
    highest_coordinator_ = leader->node_id;
  }
  if (token < highest_token_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", context_.node_id(), " refuses coordinator node ", coordinator, ": its token ",
        token, " is lower than token ", highest_token_, " of node ", highest_coordinator_,
        ", so it was deposed"));
  }
  highest_token_ = token;
  highest_coordinator_ = coordinator;
  return absl::OkStatus();
}

absl::StatusOr<v1::PrepareResponse> Participant::Prepare(const v1::PrepareRequest& request) {
  const int64_t step = request.step();
  if (absl::Status status = Fence(request.token(), request.coordinator()); !status.ok()) {
    return status;
  }
  const absl::Time deadline = absl::Now() + CappedWait(request.timeout_ms());
  // A node that just started checks first whether it is behind; that takes a read of the log.
  if (rebuilder_->BehindAfterCheck(std::min(deadline, absl::Now() + kBaseWait))) {
    if (context_.options().allow_degraded) return PrepareAbsent(request, deadline);
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", context_.node_id(),
        " does not hold its data of the latest committed step (rebuilding or unrecoverable)"));
  }
  // The step's image builds on the latest committed one: that decision is applied first.
  const std::optional<int64_t> base =
      request.has_base_step() ? std::optional<int64_t>(request.base_step()) : std::nullopt;
  if (absl::Status status = CatchUp(base, deadline); !status.ok()) return status;
  {
    const std::optional<int64_t> committed = CommittedStep();
    absl::MutexLock lock(&mutex_);
    if (DecidedLocked(step, committed)) {
      return absl::FailedPreconditionError(absl::StrCat("step ", step, " is already decided"));
    }
  }
  absl::StatusOr<NodeImage> image = store_->WaitNodeCaptured(step, deadline);
  if (!image.ok()) return image.status();
  image->set_node_id(context_.node_id());
  v1::PrepareResponse response;
  *response.mutable_image() = image->manifest();
  if (const std::optional<int64_t> committed = CommittedStep()) {
    response.set_committed_step(*committed);
  }
  PreparedStep prepared;
  prepared.image = std::make_shared<const NodeImage>(*std::move(image));
  prepared.reported = std::make_shared<const std::string>(ImageBytes(response.image()));
  Open(step, request.token(), request.coordinator(), std::move(prepared));
  return response;
}

void Participant::OpenProposed(int64_t step, const LeaderView& leader,
                               v1::ProposeRequest& proposal) {
  // A node that rebuilds is absent from the step: the coordinator's Prepare finds out whether it
  // receives the step's parity. One that has not checked yet is prepared as well.
  if (rebuilder_->BehindAfterCheck(absl::InfinitePast())) return;
  {
    // Only a step never opened: one a coordinator prepared, or a proposal opened, is reopened by
    // a fenced Prepare alone (the step may be decided already under the token it was opened under).
    absl::MutexLock lock(&mutex_);
    if (open_.contains(step)) return;
  }
  // The image holds the committed versions of the regions the step did not capture: it is the
  // coordinator's to take only on the same committed step, so no decision is applied meanwhile.
  absl::MutexLock apply_lock(&apply_mutex_);
  const std::optional<int64_t> committed = CommittedStep();
  if (committed && step <= *committed) return;
  absl::StatusOr<NodeImage> captured = store_->WaitNodeCaptured(step, absl::Now());
  if (!captured.ok()) return;
  captured->set_node_id(context_.node_id());
  const auto image = std::make_shared<const NodeImage>(*std::move(captured));
  const v1::NodeImage& manifest = image->manifest();
  // Sent as its changes since this node's image in the record of the committed step, which the
  // coordinator that committed it holds too; the image's bytes are then spliced from that image's.
  std::optional<ImagePatchOf> patch;
  std::string bytes;
  const int position = context_.topology->position;
  if (const ClusterStore::RecordWithBytes held = store_->ClusterRecordWithBytes();
      committed && held.record->committed_step() == *committed &&
      position < held.record->group_images_size()) {
    patch = PatchOf(held.record->group_images(position), held.ImageBytesOf(position), manifest,
                    bytes);
  }
  if (!patch) ImageBytesInto(manifest, bytes);
  auto reported = std::make_shared<const std::string>(std::move(bytes));
  {
    absl::MutexLock lock(&mutex_);
    if (decided_.contains(step) || open_.contains(step)) return;
    PreparedStep& open = open_[step];
    open.token = leader.token;
    open.coordinator = leader.node_id;
    open.image = image;
    open.reported = reported;
  }
  if (patch) {
    ImageBytesInto(patch->changes, *proposal.mutable_image());
    *proposal.mutable_patch() = std::move(patch->patch);
  } else {
    proposal.set_image(*reported);
  }
  if (committed) proposal.set_committed_step(*committed);
  proposal.set_token(leader.token);
}

int64_t Participant::OpenTokenOf(int64_t step) const {
  absl::MutexLock lock(&mutex_);
  auto it = open_.find(step);
  return it == open_.end() ? 0 : it->second.token;
}

void Participant::Open(int64_t step, int64_t token, uint32_t coordinator, PreparedStep prepared) {
  prepared.token = token;
  prepared.coordinator = coordinator;
  bool reopened = false;
  {
    absl::MutexLock lock(&mutex_);
    PreparedStep& open = open_[step];
    reopened = open.token != 0 && open.token != token;
    open = std::move(prepared);
  }
  // Parity an earlier coordinator's encode opened is dropped with its frames.
  if (reopened) parity_->Abort(step);
}

v1::PrepareResponse Participant::PrepareAbsent(const v1::PrepareRequest& request,
                                               absl::Time deadline) {
  const int64_t step = request.step();
  v1::PrepareResponse response;
  response.set_rebuilding(true);
  response.mutable_image()->set_node_id(context_.node_id());
  if (const std::optional<int64_t> committed = CommittedStep()) {
    response.set_committed_step(*committed);
  }
  // Without a base there is nothing to take deltas against (and no degraded step either).
  if (!request.has_base_step()) return response;
  absl::StatusOr<v1::JournalCluster> base = BaseRecord(request.base_step(), deadline);
  std::vector<uint64_t> sizes;
  if (base.ok()) {
    for (const v1::NodeImage& member : base->group_images()) sizes.push_back(member.bytes());
  }
  if (!base.ok() || !parity_->Fits(sizes)) {
    // Absent without its deltas: one more rebuild once the step commits, never an abort of it.
    Log(LogLevel::kInfo, "node ", context_.node_id(), " rebuilds and does not receive the parity ",
        "of step ", step, ": ",
        base.ok() ? absl::StrCat("its pool has no room for ", parity_->UnitBytes(sizes),
                                 " bytes of parity")
                  : std::string(base.status().message()));
    return response;
  }
  response.set_receiver(true);
  PreparedStep prepared;
  prepared.receiver = true;
  prepared.base_record = *std::move(base);
  Open(step, request.token(), request.coordinator(), std::move(prepared));
  return response;
}

absl::StatusOr<v1::JournalCluster> Participant::BaseRecord(int64_t base, absl::Time deadline) {
  const Topology& topology = *context_.topology;
  const std::vector<uint32_t>& group = topology.groups[topology.group];
  if (const std::shared_ptr<const v1::JournalCluster> record = store_->ClusterRecord();
      record->has_committed_step() && record->committed_step() == base &&
      record->group_images_size() == static_cast<int>(group.size())) {
    v1::JournalCluster without_parity = *record;
    without_parity.clear_parity();
    return without_parity;
  }
  // The members apply the base's decision as they prepare this step: one may be a moment behind.
  const absl::Time until = std::min(deadline, absl::Now() + kBaseWait);
  while (true) {
    for (uint32_t id : group) {
      if (id == context_.node_id()) continue;
      absl::StatusOr<v1::GroupStateResponse> state = context_.peers->GroupState(id);
      if (!state.ok() || state->rebuilding() || !state->cluster().has_committed_step() ||
          state->cluster().committed_step() != base ||
          !CheckGroupRecord(state->cluster(), group, topology.limits).ok()) {
        continue;
      }
      return state->cluster();
    }
    if (absl::Now() >= until || stopping()) {
      return absl::UnavailableError(absl::StrCat("no member of group ", topology.group,
                                                 " answers with its record of step ", base));
    }
    absl::MutexLock lock(&mutex_);
    changed_.WaitWithDeadline(&mutex_, std::min(until, absl::Now() + kProposerWake));
  }
}

absl::Status Participant::CatchUp(std::optional<int64_t> base, absl::Time deadline) {
  auto behind = [&](const std::optional<int64_t>& committed) {
    return base && (!committed || *committed < *base);
  };
  std::optional<int64_t> committed = CommittedStep();
  // A node that went back to a durable step holds none of the steps committed before: it has
  // nothing to apply, and the coordinator has its group encode whole.
  if (const std::optional<int64_t> replaced = rebuilder_->replaced_through();
      behind(committed) && replaced && *base <= *replaced) {
    return absl::OkStatus();
  }
  if (behind(committed)) {
    // A decision this node missed (its watch lagged, or it was cut off): read it from the log.
    absl::StatusOr<std::vector<v1::StepDecision>> missed = log_->DecisionsAfter(committed);
    if (missed.ok()) {
      for (const v1::StepDecision& decision : *missed) {
        if (decision.step() > *base) break;
        Apply(decision);
      }
    }
    committed = CommittedStep();
  }
  const absl::Time until = std::min(deadline, absl::Now() + kBaseWait);
  while (behind(committed) && absl::Now() < until) {
    {
      absl::MutexLock lock(&mutex_);
      changed_.WaitWithDeadline(&mutex_, std::min(until, absl::Now() + kProposerWake));
    }
    committed = CommittedStep();
  }
  if (committed != base) {
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", context_.node_id(), " holds ", StepText(committed),
        " committed, and the coordinator encodes against ", StepText(base),
        committed && base && *committed > *base ? " (the coordinator is behind)" : ""));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::EncodeResponse> Participant::Encode(const v1::EncodeRequest& request) {
  const erasure::StripeLayout& layout = context_.layout();
  const Topology& topology = *context_.topology;
  const int64_t step = request.step();
  absl::StatusOr<std::set<int>> absent = AbsentPositions(request, topology);
  if (!absent.ok()) return absent.status();
  // The images are parsed and checked before anything acts on the request; a whole one in the
  // memory of the image it replaces, that of a replaced record (a parity receiver keeps none).
  SpareRecord spare;
  if (!request.parity_only()) {
    absl::MutexLock lock(&mutex_);
    spare = std::move(spare_record_);
  }
  SentImages carried = ParsedImages(request, topology, *absent, std::move(spare));
  // A request refused before its images are built gives their memory back, for the next one.
  absl::Cleanup give_back = [&] {
    if (!carried.spare.record) return;
    SpareRecord unused = std::move(carried).Unused();
    absl::MutexLock lock(&mutex_);
    if (!spare_record_.record) spare_record_ = std::move(unused);
  };
  if (!carried.status.ok()) return carried.status;
  if (absl::Status status = Fence(request.token(), request.coordinator()); !status.ok()) {
    return status;
  }
  if (request.parity_only()) {
    // Each image was checked as it was parsed (a parity-only encode carries no patch): what is
    // left is that each is its member's.
    const std::vector<uint32_t>& group = topology.groups[topology.group];
    for (size_t position = 0; position < group.size(); ++position) {
      if (absl::Status status =
              CheckImageMember(carried.images[position], position, group[position]);
          !status.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("step ", step, ": ", status.message()));
      }
    }
    return EncodeReceived(request, std::move(carried.images), *absent);
  }
  auto not_prepared = [&] {
    return absl::FailedPreconditionError(absl::StrCat("step ", step,
                                                      " was not prepared here by node ",
                                                      request.coordinator(), " under token ",
                                                      request.token()));
  };
  std::shared_ptr<const NodeImage> image;
  {
    absl::MutexLock lock(&mutex_);
    auto it = open_.find(step);
    if (it == open_.end() || it->second.token != request.token()) return not_prepared();
    image = it->second.image;
  }
  const absl::Time deadline = absl::Now() + CappedWait(request.timeout_ms());
  // Parity follows the decided sequence: this node's committed step must be the base every node
  // of the group takes its deltas against.
  const std::optional<int64_t> base =
      request.has_base_step() ? std::optional<int64_t>(request.base_step()) : std::nullopt;
  if (absl::Status status = CatchUp(base, deadline); !status.ok()) return status;
  if (!carried.spare.record) {
    // The base's decision, applied just now, replaced a record.
    absl::MutexLock lock(&mutex_);
    carried.spare = std::move(spare_record_);
  }
  // A step that keeps every node's layout updates the committed parity with the deltas of the
  // units it changed, and encodes afresh the stripes whose units all changed (StepChanges);
  // anything else (the first step, a rank registering new regions) encodes whole.
  // Every node of the group decides the same from the same two records, unless the coordinator
  // found that the group's nodes do not hold the same committed step.
  const ClusterStore::RecordWithBytes held = store_->ClusterRecordWithBytes();
  const v1::JournalCluster& committed = *held.record;
  absl::StatusOr<GroupImages> images =
      GroupImagesOf(request, topology, held, *absent, std::move(carried));
  if (!images.ok()) return images.status();
  const std::vector<v1::NodeImage>& group_images = images->images;
  std::shared_ptr<const std::string> reported;
  {
    absl::MutexLock lock(&mutex_);
    auto it = open_.find(step);
    if (it == open_.end() || it->second.token != request.token()) return not_prepared();
    reported = it->second.reported;
  }
  // This node's own image must be the one it reported, field for field: its regions decide which
  // units are sent and, once committed, how a rebuild lays them out.
  if (reported == nullptr || images->bytes[topology.position] != *reported) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step, ": the image of node ", context_.node_id(),
        " in the request differs from the one it prepared"));
  }
  std::set<uint32_t> absent_nodes;  // those that get nothing from this node
  for (int position : *absent) absent_nodes.insert(topology.NodeAt(position));
  for (uint32_t id : request.parity_receivers()) absent_nodes.erase(id);
  std::vector<uint64_t> image_bytes;
  for (const v1::NodeImage& member : group_images) image_bytes.push_back(member.bytes());
  // The commit journals every member's image: a step this node's journal could not hold aborts
  // here, before any parity moves, instead of being committed by the group and lost by this node.
  if (absl::Status room =
          store_->JournalRoomFor(*image, topology.position, images->bytes,
                                 layout.StripeCount(image_bytes));
      !room.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("step ", step, ": node ", context_.node_id(),
                                                     " cannot journal it: ", room.message()));
  }
  bool delta = !request.whole() && committed.has_committed_step() &&
               committed.group_images_size() == layout.group_size();
  std::vector<std::vector<bool>> units;  // with delta, each member's changed units
  for (int position = 0; delta && position < layout.group_size(); ++position) {
    const v1::NodeImage& before = committed.group_images(position);
    const auto built_on = images->changed_regions.find(position);
    std::optional<std::vector<bool>> changed =
        built_on == images->changed_regions.end()
            ? ChangedUnits(before, group_images[position], layout.unit_bytes())
            : ChangedUnitsAt(before, group_images[position], built_on->second,
                             layout.unit_bytes());
    delta = changed.has_value();
    if (delta) units.push_back(*std::move(changed));
  }
  if (!absent->empty() && !delta) {
    // A whole encode needs every data unit of a stripe, the absent nodes' too.
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " is degraded (nodes [", absl::StrJoin(request.absent_nodes(), ", "),
        "] absent) and a live node's layout changed since step ", committed.committed_step(),
        ": it cannot go as deltas"));
  }
  std::optional<StepChanges> changes;
  std::vector<std::shared_ptr<PoolBytes>> committed_bytes;  // what the deltas XOR with
  if (delta) {
    changes = ChangesOf(layout, std::move(units), image_bytes, *absent);
    // This node's image keeps the layout of its image in the record (the changed units were
    // found so): the regions the deltas read lie at the same positions in both.
    absl::StatusOr<std::vector<std::shared_ptr<PoolBytes>>> found = store_->CommittedBytesOf(
        committed.group_images(topology.position), transfer_->DeltaRegions(*image, *changes));
    if (!found.ok()) {
      // The record and the store disagree on this node's committed step: deltas against it
      // would corrupt the group's parity. Found before the parity opens, so nothing is held.
      return absl::Status(found.status().code(), absl::StrCat("step ", step,
                                                              " cannot go as deltas: ",
                                                              found.status().message()));
    }
    committed_bytes = *std::move(found);
  }
  const StepChanges* step_changes = changes ? &*changes : nullptr;
  if (absl::Status status =
          OpenParity(step, request.token(), image_bytes, step_changes, /*accumulate=*/false);
      !status.ok()) {
    return status;
  }
  absl::StatusOr<uint64_t> sent = transfer_->SendDataUnits(
      step, request.token(), *image, delta ? &committed_bytes : nullptr, step_changes,
      absent_nodes);
  if (absl::Status status = CompleteEncode(request, sent.status(), deadline,
                                           *std::move(images), "encoded it");
      !status.ok()) {
    return status;
  }
  {
    absl::MutexLock lock(&mutex_);
    (delta ? delta_encodes_ : full_encodes_)++;
    parity_bytes_sent_ += *sent;
  }
  v1::EncodeResponse response;
  response.set_bytes_sent(*sent);
  response.set_delta(delta);
  response.set_parity_bytes(parity_->in_flight_bytes());
  return response;
}

absl::Status Participant::OpenParity(int64_t step, int64_t token,
                                     const std::vector<uint64_t>& image_bytes,
                                     const StepChanges* changes, bool accumulate) {
  if (absl::Status status = parity_->Begin(step, token, image_bytes, changes, accumulate);
      !status.ok()) {
    return status;
  }
  // A decision applied while this call got here (another node failed the step at once) dropped
  // the parity before it was opened: nothing would end the wait for units after this.
  bool decided = false;
  {
    const std::optional<int64_t> committed_step = CommittedStep();
    absl::MutexLock lock(&mutex_);
    decided = DecidedLocked(step, committed_step);
  }
  if (decided) {
    parity_->Abort(step);
    return absl::AbortedError(
        absl::StrCat("step ", step, " was decided while this node opened its parity"));
  }
  return absl::OkStatus();
}

absl::Status Participant::CompleteEncode(const v1::EncodeRequest& request, absl::Status sending,
                                         absl::Time deadline,
                                         GroupImages group_images,
                                         absl::string_view doing) {
  const int64_t step = request.step();
  absl::Status status = std::move(sending);
  if (status.ok()) status = parity_->WaitComplete(step, deadline);
  if (!status.ok()) {
    parity_->Abort(step);
    return status;
  }
  absl::MutexLock lock(&mutex_);
  auto it = open_.find(step);
  if (it == open_.end() || it->second.token != request.token()) {
    return absl::AbortedError(absl::StrCat("step ", step, " was decided or prepared again while "
                                           "this node ", doing));
  }
  it->second.group_images = std::move(group_images);
  it->second.encoded = true;
  return absl::OkStatus();
}

absl::StatusOr<v1::EncodeResponse> Participant::EncodeReceived(const v1::EncodeRequest& request,
                                                               std::vector<v1::NodeImage> sent,
                                                               const std::set<int>& absent) {
  const erasure::StripeLayout& layout = context_.layout();
  const Topology& topology = *context_.topology;
  const int64_t step = request.step();
  v1::JournalCluster base;
  {
    absl::MutexLock lock(&mutex_);
    auto it = open_.find(step);
    if (it == open_.end() || it->second.token != request.token() || !it->second.receiver) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step, " was not prepared here as a parity receiver by node ",
          request.coordinator(), " under token ", request.token()));
    }
    base = it->second.base_record;
  }
  if (!request.has_base_step() || request.base_step() != base.committed_step()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, ": node ", context_.node_id(), " prepared as a parity receiver against step ",
        base.committed_step(), ", and the coordinator encodes against ",
        StepText(request.has_base_step() ? std::optional<int64_t>(request.base_step())
                                         : std::nullopt)));
  }
  // The live members' new images, the absent ones' of the base step: the senders' own view.
  GroupImages images;
  images.images = std::move(sent);
  for (int position : absent) images.images[position] = base.group_images(position);
  // As sent, as a member's are (GroupImagesOf); the absent members' as the base record holds them.
  for (int position = 0; position < static_cast<int>(images.images.size()); ++position) {
    images.bytes.push_back(absent.contains(position) ? ImageBytes(images.images[position])
                                                     : request.group_images(position));
  }
  const std::vector<v1::NodeImage>& group_images = images.images;
  std::vector<uint64_t> image_bytes;
  std::vector<std::vector<bool>> units;
  for (int position = 0; position < layout.group_size(); ++position) {
    std::optional<std::vector<bool>> changed =
        ChangedUnits(base.group_images(position), group_images[position], layout.unit_bytes());
    if (!changed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step, ": node ", topology.NodeAt(position), "'s layout changed since step ",
          base.committed_step(), ", so the step cannot go as deltas"));
    }
    image_bytes.push_back(group_images[position].bytes());
    units.push_back(*std::move(changed));
  }
  // This node is absent, so none of the stripes whose parity it holds is fresh.
  const StepChanges changes = ChangesOf(layout, std::move(units), image_bytes, absent);
  if (absl::Status status =
          OpenParity(step, request.token(), image_bytes, &changes, /*accumulate=*/true);
      !status.ok()) {
    return status;
  }
  const absl::Time deadline = absl::Now() + CappedWait(request.timeout_ms());
  if (absl::Status status = CompleteEncode(request, absl::OkStatus(), deadline,
                                           std::move(images), "received its parity");
      !status.ok()) {
    return status;
  }
  v1::EncodeResponse response;
  response.set_delta(true);
  response.set_parity_bytes(parity_->in_flight_bytes());
  return response;
}

void Participant::Apply(const v1::StepDecision& decision) {
  absl::MutexLock apply_lock(&apply_mutex_);
  const int64_t step = decision.step();
  const std::optional<int64_t> committed = CommittedStep();
  std::optional<PreparedStep> open;
  {
    absl::MutexLock lock(&mutex_);
    if (DecidedLocked(step, committed)) return;  // applied before
    decided_[step] = decision.committed();
    if (decision.token() > highest_token_) {
      highest_token_ = decision.token();
      highest_coordinator_ = decision.coordinator();
    }
    // Taken out, not copied: it holds every group member's image, and the decision ends it.
    if (auto it = open_.find(step); it != open_.end()) {
      open = std::move(it->second);
      open_.erase(it);
    }
  }
  if (!decision.committed()) {
    store_->AbortNodeStep(step, absl::AbortedError(absl::StrCat(
                                    "the cluster aborted step ", step, ": ", decision.reason())));
    parity_->Discard(step);
    absl::MutexLock lock(&mutex_);
    open_.erase(step);
    last_abort_ = absl::StrCat("step ", step, ": ", decision.reason());
    changed_.SignalAll();
    return;
  }
  if (const std::optional<int64_t> replaced = rebuilder_->replaced_through();
      !open && replaced && step <= *replaced) {
    // Committed by the run the job went back from: nothing of it is held here.
    absl::MutexLock lock(&mutex_);
    changed_.SignalAll();
    return;
  }
  absl::Status status;
  const bool absent_here = std::find(decision.absent().begin(), decision.absent().end(),
                                     context_.node_id()) != decision.absent().end();
  if (absent_here && open && open->receiver && open->encoded && open->token == decision.token() &&
      parity_->KeepAccumulated(step, decision.token(), open->base_record.committed_step(),
                               open->group_images.images)) {
    // Committed while this node rebuilt, its parity change received: the rebuilder folds it in.
    Log(LogLevel::kInfo, "node ", context_.node_id(), " received the parity of step ", step,
        ", committed while it rebuilds");
    rebuilder_->NoteBehind(step);
    absl::MutexLock lock(&mutex_);
    open_.erase(open_.begin(), open_.upper_bound(step));
    changed_.SignalAll();
    return;
  }
  if (absent_here) {
    // Committed without this node (it was lost, or it rebuilt and did not receive the step's
    // parity): its data stays the image it last committed, and the parity it holds was not
    // updated; the rebuild brings both.
    status = absl::DataLossError(absl::StrCat(
        "step ", step, " was committed with this node absent (degraded)"));
  } else if (!open || !open->encoded || open->token != decision.token()) {
    status = absl::DataLossError(absl::StrCat(
        "step ", step, " was committed under token ", decision.token(), " but this node ",
        !open ? "never prepared it" : !open->encoded ? "did not finish encoding it"
                                                     : absl::StrCat("encoded it under token ",
                                                                    open->token)));
  } else {
    v1::JournalCluster record;
    record.set_committed_step(step);
    for (v1::NodeImage& image : open->group_images.images) {
      *record.add_group_images() = std::move(image);
    }
    for (v1::JournalParity& parity : parity_->Records(step)) {
      *record.add_parity() = std::move(parity);
    }
    std::shared_ptr<const v1::JournalCluster> replaced = store_->ClusterRecord();
    const bool built_on_replaced = IsRecord(open->group_images.base, replaced);
    absl::StatusOr<std::shared_ptr<const v1::JournalCluster>> installed =
        store_->CommitNodeStep(step, std::move(record), std::move(open->group_images.bytes));
    status = installed.status();
    if (status.ok()) parity_->Commit(step);
    // Once nobody else holds the record this commit replaced, its images' memory builds the next
    // step's (GroupImagesOf) instead of being freed, region by region, and allocated again. When
    // the images committed were built on it, it also knows where each differs from them: the next
    // step copies a committed image into it by those regions alone.
    if (status.ok() && replaced.use_count() == 1) {
      // Its last other holder's reads of it happen before the writes into it.
      std::atomic_thread_fence(std::memory_order_acquire);
      SpareRecord spare{.record = std::const_pointer_cast<v1::JournalCluster>(std::move(replaced))};
      if (built_on_replaced) {
        spare.base_of = *installed;
        spare.differs_at = std::move(open->group_images.changed_regions);
        for (int position : open->group_images.unknown_fields) spare.differs_at.erase(position);
      }
      SpareRecord dropped;  // freed after the lock
      absl::MutexLock lock(&mutex_);
      dropped = std::exchange(spare_record_, std::move(spare));
    }
  }
  if (!status.ok()) {
    // The group committed the step without this node holding its part of it: rebuild it.
    Log(LogLevel::kWarning, "node ", context_.node_id(), " is behind its group: ",
        status.message());
    parity_->Abort(step);
    rebuilder_->NoteBehind(step);
  }
  absl::MutexLock lock(&mutex_);
  open_.erase(open_.begin(), open_.upper_bound(step));
  // What is committed now answers for the steps up to it; a commit this node could not take stays
  // recorded as decided until its rebuild installs it.
  if (status.ok()) {
    decided_.erase(decided_.begin(), decided_.upper_bound(step));
    if (decision.absent_size() > 0) ++degraded_commits_;
    latest_absent_.assign(decision.absent().begin(), decision.absent().end());
  }
  changed_.SignalAll();
}

std::optional<int64_t> Participant::OpenStep() const {
  absl::MutexLock lock(&mutex_);
  if (open_.empty()) return std::nullopt;
  return open_.rbegin()->first;
}

int64_t Participant::highest_token() const {
  absl::MutexLock lock(&mutex_);
  return highest_token_;
}

std::vector<uint32_t> Participant::latest_absent() const {
  absl::MutexLock lock(&mutex_);
  return latest_absent_;
}

std::string Participant::last_abort() const {
  absl::MutexLock lock(&mutex_);
  return last_abort_;
}

}  // namespace moesnap::daemon::cluster
