// Coordinator: the campaign, what is decided, rounds, and fenced decisions.
#include "daemon/cluster/coordinator.h"

#include <google/protobuf/arena.h>
#include <signal.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "daemon/cluster/durable_records.h"
#include "daemon/cluster/group_shards.h"
#include "daemon/cluster/image_patch.h"
#include "daemon/cluster/peer_checks.h"

namespace moesnap::daemon::cluster {
namespace {

// How long a leader waits for proposals before it looks whether it still leads.
constexpr absl::Duration kIdleWake = absl::Milliseconds(100);
constexpr absl::Duration kMaxDecideBackoff = absl::Seconds(1);
// Proposals waiting for a round; legitimate ones are a few steps of each node.
constexpr size_t kMaxProposals = 4096;
// The images proposals bring for rounds not begun; beyond, a node is prepared instead.
constexpr uint64_t kMaxProposedImageBytes = uint64_t{256} << 20;
// How long a step this node captured waits for the proposals of the other live nodes before its
// round begins; the round prepares the nodes whose proposal is still missing then (one that
// captures later, or one without trainers that proposed none since the round before).
constexpr absl::Duration kProposalWait = absl::Milliseconds(20);

}  // namespace

Coordinator::Coordinator(const ClusterContext& context, Leadership* leadership, DecisionLog* log,
                         const ClusterStore* store, DurableRecords* records,
                         const CoordinatorOptions& options)
    : context_(context), leadership_(leadership), log_(log), store_(store), records_(records),
      options_(options) {}

Coordinator::~Coordinator() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    changed_.SignalAll();
  }
  if (loop_.joinable()) loop_.join();
}

void Coordinator::Start() {
  loop_ = std::thread([this] {
    while (!stopping()) {
      absl::StatusOr<int64_t> token = leadership_->Campaign(options_.campaign_wait);
      if (!token.ok()) {
        if (!absl::IsDeadlineExceeded(token.status())) {
          absl::MutexLock lock(&mutex_);
          changed_.WaitWithTimeout(&mutex_, options_.campaign_wait);
        }
        continue;
      }
      Lead(*token);
      // Stepping down lets the next candidate lead at once instead of after a lease.
      leadership_->Resign(*token);
    }
  });
}

bool Coordinator::stopping() const {
  absl::MutexLock lock(&mutex_);
  return stopping_;
}

int64_t Coordinator::token() const {
  absl::MutexLock lock(&mutex_);
  return token_;
}

absl::StatusOr<v1::ProposeResponse> Coordinator::Propose(const v1::ProposeRequest& request) {
  // A whole image is parsed into the memory of one a round is done with, outside the lock.
  v1::NodeImage image;
  if (request.has_image()) {
    if (!request.has_patch()) {
      absl::MutexLock lock(&mutex_);
      if (!image_memory_.empty()) {
        image = std::move(image_memory_.back());
        image_memory_.pop_back();
      }
    }
    if (absl::Status status = ParseProposedImage(request, context_.topology->limits, image);
        !status.ok()) {
      return status;
    }
  }
  absl::MutexLock lock(&mutex_);
  if (token_ == 0) {
    const std::optional<LeaderView> leader = context_.nodes->Leader();
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", context_.node_id(), " does not coordinate",
        leader ? absl::StrCat("; node ", leader->node_id, " does (token ", leader->token, ")")
               : ""));
  }
  v1::ProposeResponse response;
  if (decided_.contains(request.step()) || (base_ && request.step() <= *base_)) {
    response.set_decided(true);
    return response;
  }
  if (proposals_.size() >= kMaxProposals && !proposals_.contains(request.step())) {
    // The furthest ahead give way: the job's next steps are the lowest.
    if (request.step() > proposals_.rbegin()->first) {
      return absl::ResourceExhaustedError(absl::StrCat(
          kMaxProposals, " proposals wait already, all before step ", request.step()));
    }
    TakeProposalsLocked(proposals_.rbegin()->first);
  }
  StepProposals& proposals = proposals_[request.step()];
  if (proposals.proposers.size() <= request.from_node()) {
    proposals.proposers.resize(request.from_node() + 1);  // a node id of the job (CheckPropose)
  }
  proposals.proposers[request.from_node()] = true;
  if (request.token() != 0) {
    if (proposals.holders.size() <= request.from_node()) {
      proposals.holders.resize(request.from_node() + 1);
    }
    proposals.holders[request.from_node()] = true;
  }
  if (request.has_image()) KeepProposedImageLocked(request, std::move(image), proposals);
  changed_.SignalAll();
  return response;
}

void Coordinator::KeepProposedImageLocked(const v1::ProposeRequest& request, v1::NodeImage image,
                                          StepProposals& proposals) {
  if (auto kept = proposals.images.find(request.from_node()); kept != proposals.images.end()) {
    proposed_image_bytes_ -= kept->second.bytes;
    proposals.images.erase(kept);
  }
  // An image opened under another token, or for a round begun already, stands for nothing.
  if (request.token() != token_ || (last_round_ && request.step() <= *last_round_)) return;
  // What the image takes here, parsed and as it came, with what keeping it costs beside them.
  const uint64_t bytes = 2 * request.image().size() + sizeof(ProposedImage) + 64;
  // The images of the steps furthest ahead give way: the job's next steps are the lowest.
  for (auto it = proposals_.rbegin();
       bytes > kMaxProposedImageBytes - proposed_image_bytes_ && it != proposals_.rend() &&
       it->first > request.step();
       ++it) {
    ClearImagesLocked(it->second);
  }
  if (bytes > kMaxProposedImageBytes - proposed_image_bytes_) return;
  ProposedImage& kept = proposals.images[request.from_node()];
  if (request.has_committed_step()) kept.committed = request.committed_step();
  kept.image = std::move(image);
  if (request.has_patch()) {
    kept.patch = request.patch();
  } else {
    kept.image_bytes = request.image();
  }
  kept.bytes = bytes;
  proposed_image_bytes_ += bytes;
}

Coordinator::StepProposals Coordinator::TakeProposalsLocked(int64_t step) {
  auto it = proposals_.find(step);
  if (it == proposals_.end()) return {};
  StepProposals taken = std::move(it->second);
  proposals_.erase(it);
  for (const auto& [id, image] : taken.images) proposed_image_bytes_ -= image.bytes;
  return taken;
}

void Coordinator::ClearImagesLocked(StepProposals& proposals) {
  for (const auto& [id, image] : proposals.images) proposed_image_bytes_ -= image.bytes;
  proposals.images.clear();
}

void Coordinator::DropProposedImagesLocked() {
  for (auto& [step, proposals] : proposals_) ClearImagesLocked(proposals);
}

std::optional<absl::Time> Coordinator::OwnCaptureDeadline(const StepProposals& proposals) const {
  if (!proposals.open_since) return std::nullopt;
  return *proposals.open_since + absl::Milliseconds(context_.options().commit_timeout_ms);
}

std::optional<int64_t> Coordinator::NextRoundLocked(absl::Time* wake) {
  const absl::Time now = absl::Now();
  std::map<uint32_t, int> held_lower;  // by holder, the steps before this one it holds open
  for (auto& [step, proposals] : proposals_) {
    // Timed while among the lowest kTimedOpenStepsPerNode steps of one of its holders; a step
    // that leaves that window (a lower claim came) starts again when it is back in.
    bool timed = false;
    for (uint32_t id = 0; id < proposals.holders.size(); ++id) {
      if (proposals.holders[id] && held_lower[id]++ < kTimedOpenStepsPerNode) timed = true;
    }
    if (!timed) {
      proposals.open_since.reset();
    } else if (!proposals.open_since) {
      proposals.open_since = now;
    }
    // A round begins once this node captured the step (or passed it), so that its Prepare does not
    // wait out the commit timeout for a trainer still training towards it. But the nodes holding a
    // step open wait for its decision, and so do their restores: when this node's trainers are
    // gone or restarting (the old coordinator may have died with the job's), it would wait
    // forever. So such a step waits for this node's capture at most the commit timeout, then
    // RunRound aborts it.
    if (store_->CaptureOf(step) == NodeCapture::kNotYet) {
      const std::optional<absl::Time> until = OwnCaptureDeadline(proposals);
      if (!until) continue;
      if (now < *until) {
        *wake = std::min(*wake, *until);
        continue;
      }
    }
    // A node proposes the steps its trainers capture: the round waits a moment for the live
    // nodes' proposals still missing, whose images spare their nodes' Prepare. A node that did not
    // propose the last round's step (one without trainers) is not waited for.
    auto proposed = [](const std::vector<bool>& proposers, uint32_t id) {
      return id < proposers.size() && proposers[id];
    };
    bool every_expected = true;
    for (uint32_t id : context_.nodes->LiveIds()) {
      if ((!last_proposers_ || proposed(*last_proposers_, id)) &&
          !proposed(proposals.proposers, id)) {
        every_expected = false;
      }
    }
    if (!every_expected) {
      if (!proposals.waiting_since) proposals.waiting_since = now;
      const absl::Time until = *proposals.waiting_since + kProposalWait;
      if (now < until) {
        *wake = std::min(*wake, until);
        return std::nullopt;
      }
    }
    return step;
  }
  return std::nullopt;
}

void Coordinator::Lead(int64_t token) {
  // What is decided already: the previous coordinators' decisions, read from etcd.
  absl::StatusOr<std::vector<v1::StepDecision>> known = log_->DecisionsAfter(std::nullopt);
  while (!known.ok()) {
    if (stopping() || !leadership_->Holds(token)) return;
    absl::MutexLock lock(&mutex_);
    changed_.WaitWithTimeout(&mutex_, kIdleWake);
    known = log_->DecisionsAfter(std::nullopt);
  }
  std::optional<int64_t> latest;
  {
    absl::MutexLock lock(&mutex_);
    decided_.clear();
    base_.reset();
    last_round_.reset();
    for (const v1::StepDecision& decision : *known) {
      decided_[decision.step()] = decision.committed();
      if (decision.committed()) base_ = decision.step();
      last_round_ = decision.step();
    }
    // Proposals made to an earlier leadership of this node: each node proposes again to this one.
    DropProposedImagesLocked();
    last_proposers_.reset();
    for (auto it = proposals_.begin(); it != proposals_.end();) {
      if (decided_.contains(it->first)) {
        it = proposals_.erase(it);
        continue;
      }
      it->second.proposers.clear();
      it->second.holders.clear();
      it->second.waiting_since.reset();
      it->second.open_since.reset();
      ++it;
    }
    token_ = token;
    latest = base_;
  }
  Log(LogLevel::kInfo, "node ", context_.node_id(), " coordinates with fencing token ", token,
      "; the latest committed step is ", latest ? absl::StrCat(*latest) : "none");
  while (!stopping() && leadership_->Holds(token)) {
    std::optional<int64_t> step;
    {
      absl::MutexLock lock(&mutex_);
      absl::Time wake = absl::Now() + kIdleWake;
      step = NextRoundLocked(&wake);
      if (!step) {
        changed_.WaitWithDeadline(&mutex_, wake);
        wake = absl::Now() + kIdleWake;
        step = NextRoundLocked(&wake);
      }
    }
    if (step && !RunRound(*step, token)) break;
  }
  Log(LogLevel::kInfo, "node ", context_.node_id(), " no longer coordinates (token ", token, ")");
  // Every node's image, which a coordinator that is not one needs not hold.
  committed_images_.clear();
  committed_image_bytes_.clear();
  committed_images_step_.reset();
  spare_images_.clear();
  spare_image_bytes_.clear();
  spare_differs_at_.clear();
  absl::MutexLock lock(&mutex_);
  token_ = 0;
  DropProposedImagesLocked();
  image_memory_.clear();
}

bool Coordinator::Decide(int64_t step, int64_t token, bool committed, const std::string& reason,
                         const std::vector<uint32_t>& absent) {
  v1::StepDecision decision;
  decision.set_step(step);
  decision.set_committed(committed);
  decision.set_token(token);
  decision.set_coordinator(context_.node_id());
  decision.set_reason(reason);
  for (uint32_t id : absent) decision.add_absent(id);
  absl::Duration backoff = absl::Milliseconds(50);
  while (true) {
    absl::StatusOr<v1::StepDecision> held = log_->Decide(decision);
    if (held.ok()) {
      ++decisions_;
      if (held->committed() != committed || held->token() != token) {
        Log(LogLevel::kWarning, "step ", step, " was decided before this coordinator: ",
            held->committed() ? "committed" : "aborted", " under token ", held->token());
      }
      if (committed && held->committed() && crash_in_commit_ >= 0 && step >= crash_in_commit_) {
        Log(LogLevel::kWarning, "fault injection: SIGKILL right after deciding step ", step);
        raise(SIGKILL);
      }
      std::optional<int64_t> forget;
      {
        absl::MutexLock lock(&mutex_);
        decided_[step] = held->committed();
        if (held->committed()) {
          const std::optional<int64_t> previous = base_;
          base_ = std::max(base_.value_or(step), step);
          // Every node applied the base this step was encoded against; no one needs what is older.
          if (++commits_since_forget_ >= options_.forget_every && previous) {
            commits_since_forget_ = 0;
            forget = previous;
          }
          decided_.erase(decided_.begin(), decided_.lower_bound(step));
        }
      }
      if (forget && records_ != nullptr) {
        // The decisions of the steps nodes record as durable are what a restore from disk reads;
        // if the records cannot be read now, nothing is dropped until the next time.
        absl::StatusOr<std::optional<int64_t>> oldest = records_->OldestRecorded();
        if (oldest.ok()) {
          forget = ForgetBound(*forget, *oldest);
        } else {
          Log(LogLevel::kWarning, "old decisions kept: the durable records cannot be read: ",
              oldest.status().message());
          forget.reset();
        }
      }
      if (forget) {
        const absl::Status forgotten = log_->ForgetBefore(*forget, token);
        if (!forgotten.ok()) {
          Log(LogLevel::kWarning, "old decisions not dropped: ", forgotten.message());
        }
      }
      return true;
    }
    if (absl::IsFailedPrecondition(held.status())) {
      Log(LogLevel::kWarning, "the decision of step ", step, " was refused: this coordinator ",
          "(token ", token, ") was deposed: ", held.status().message());
      return false;
    }
    // etcd out of reach: the nodes keep the step open; the decision goes in once etcd answers,
    // unless this coordinator's lease ends first (then the next one runs the step again).
    if (stopping() || !leadership_->Holds(token)) return false;
    Log(LogLevel::kWarning, "the decision of step ", step, " waits for etcd: ",
        held.status().message());
    absl::MutexLock lock(&mutex_);
    changed_.WaitWithTimeout(&mutex_, backoff);
    backoff = std::min(backoff * 2, kMaxDecideBackoff);
  }
}

absl::Status Coordinator::CheckDegraded(const std::vector<uint32_t>& lost,
                                        const std::optional<int64_t>& base) const {
  const ClusterOptions& options = context_.options();
  auto listed = [](const std::vector<uint32_t>& ids) {
    return absl::StrCat("node", ids.size() > 1 ? "s [" : " ", absl::StrJoin(ids, ", "),
                        ids.size() > 1 ? "]" : "");
  };
  std::map<int, std::vector<uint32_t>> by_group;
  for (uint32_t id : lost) by_group[options.GroupOf(id)->first].push_back(id);
  const int first_group = by_group.begin()->first;
  if (!options.allow_degraded) {
    return absl::UnavailableError(absl::StrCat(
        listed(lost), " of group ", first_group, lost.size() > 1 ? " are" : " is",
        " lost; snapshots need every node of every group (rebuild it with a replacement daemon "
        "started with its id, or set cluster.allow_degraded to commit without it)"));
  }
  for (const auto& [group, ids] : by_group) {
    if (ids.size() > static_cast<size_t>(options.parity_units)) {
      return absl::UnavailableError(absl::StrCat(
          "group ", group, " has lost ", listed(ids), ", more than m = ", options.parity_units,
          ": a step committed without them could not be recovered; steps abort until "
          "replacements rebuild them"));
    }
  }
  if (!base) {
    return absl::UnavailableError(absl::StrCat(
        listed(lost), " of group ", first_group, lost.size() > 1 ? " are" : " is",
        " lost before any step committed: a degraded step keeps a lost node's last committed "
        "image, and there is none"));
  }
  return absl::OkStatus();
}

bool Coordinator::RunRound(int64_t step, int64_t token) {
  const ClusterOptions& options = context_.options();
  std::optional<int64_t> base;
  std::optional<int64_t> passed_over_by;
  NodeCapture capture;
  StepProposals proposed;
  {
    absl::MutexLock lock(&mutex_);
    proposed = TakeProposalsLocked(step);
    if (decided_.contains(step)) return true;
    capture = store_->CaptureOf(step);
    // Not captured here: begun because the wait for this node's capture ran out (NextRoundLocked).
    // It is aborted without a round, so that no step after it is held back and no earlier one
    // passed over by it (a proposal far ahead stands for nothing).
    if (capture != NodeCapture::kNotYet) {
      last_proposers_ = proposed.proposers;
      if (last_round_ && step <= *last_round_) {
        passed_over_by = last_round_;
      } else {
        last_round_ = step;
        base = base_;
      }
    }
  }
  if (capture == NodeCapture::kNotYet) {
    // Or its capture went between NextRoundLocked and here (the rank restored an earlier step).
    const std::optional<absl::Time> until = OwnCaptureDeadline(proposed);
    const bool timed_out = until && absl::Now() >= *until;
    return Decide(step, token, false,
                  timed_out
                      ? absl::StrCat("node ", context_.node_id(), " (the coordinator's) did not "
                                     "capture it within the commit timeout (",
                                     options.commit_timeout_ms, " ms) of a proposal that held it "
                                     "open: its trainers are behind, restarting or gone")
                      : absl::StrCat("node ", context_.node_id(), " (the coordinator's) no longer "
                                     "holds its capture of it (its rank restored an earlier "
                                     "step)"));
  }
  if (capture == NodeCapture::kPassed) {
    return Decide(step, token, false,
                  absl::StrCat("node ", context_.node_id(), " (the coordinator's) captured a later "
                               "step and never this one"));
  }
  if (passed_over_by) {
    // Proposed after a later step's round began: that step passed it over.
    return Decide(step, token, false,
                  absl::StrCat("captured on a node after the round of step ", *passed_over_by,
                               " began"));
  }
  const std::vector<uint32_t> all_nodes = context_.nodes->Ids();
  const absl::Time started = absl::Now();
  std::vector<uint32_t> lost;
  for (uint32_t id : all_nodes) {
    if (!context_.nodes->Live(id)) lost.push_back(id);
  }
  if (!lost.empty()) {
    if (absl::Status degraded = CheckDegraded(lost, base); !degraded.ok()) {
      const std::string reason(degraded.message());
      Log(LogLevel::kWarning, "step ", step, " aborted: ", reason);
      return Decide(step, token, false, reason);
    }
  }
  // The nodes in the step (prepared, or their proposals' images taken): every node but the lost
  // ones, whose data stays at their last committed image in this step (a degraded step).
  std::set<uint32_t> absent(lost.begin(), lost.end());
  std::vector<uint32_t> nodes;
  for (uint32_t id : all_nodes) {
    if (!absent.contains(id)) nodes.push_back(id);
  }

  // The first node to fail a phase aborts the step at once: the other nodes' calls end as they
  // apply that decision, instead of waiting out the commit timeout for data that will not come.
  // A round's answers are taken on this thread, as they come.
  bool failed = false;
  bool deposed = false;
  auto abort_once = [&](const std::string& reason) {
    if (failed) return;
    failed = true;
    // The next round sends whole images: one a receiver could not build from its record (the
    // records differ) would fail every round patched against it.
    committed_images_.clear();
    committed_image_bytes_.clear();
    committed_images_step_.reset();
    spare_differs_at_.clear();
    Log(LogLevel::kWarning, "step ", step, " aborted: ", reason);
    if (!leadership_->Holds(token) || !Decide(step, token, false, reason)) deposed = true;
  };

  std::map<uint32_t, v1::NodeImage> images;
  // Their bytes, as the Encode requests send them: a whole proposal's as its proposer serialized
  // it, the others' serialized here (spliced, for those built from patches or made patches of).
  std::map<uint32_t, std::string> image_bytes;
  // What this coordinator kept of node `id`'s image at the base serialized, to splice from (empty:
  // the image is serialized whole), and memory for this round's, that of the bytes the last commit
  // replaced.
  auto kept_bytes = [&](uint32_t id) -> std::string_view {
    const auto kept = committed_image_bytes_.find(id);
    return kept == committed_image_bytes_.end() ? std::string_view() : kept->second;
  };
  auto spare_bytes = [&](uint32_t id) {
    const auto spare = spare_image_bytes_.find(id);
    return spare == spare_image_bytes_.end() ? std::string() : std::move(spare->second);
  };
  // The images that came as patches on the base: the Encode requests send them as they came.
  std::map<uint32_t, ImagePatchOf> proposed_patches;
  // Where each of those built here differs from its base, when it carries no field this build does
  // not know: what its base's memory knows once this step commits (spare_differs_at_).
  std::map<uint32_t, std::vector<uint32_t>> built_on_base;
  std::map<uint32_t, std::optional<int64_t>> held;  // the committed step each node holds
  // Live nodes that rebuild (absent from the step), and those of them that receive its parity.
  std::set<uint32_t> rebuilding;
  std::set<uint32_t> receivers;
  std::vector<std::pair<uint32_t, v1::PrepareRequest>> prepares;
  for (uint32_t id : nodes) {
    // A node whose proposal brought its image, built on this round's base, opened the step under
    // this token as a Prepare would have.
    if (auto found = proposed.images.find(id);
        found != proposed.images.end() && found->second.committed == base) {
      ProposedImage& proposal = found->second;
      if (!proposal.patch) {
        held[id] = base;
        images[id] = std::move(proposal.image);
        image_bytes[id] = std::move(proposal.image_bytes);
        continue;
      }
      // Its changes since the base, built on the image this coordinator committed then; a node
      // whose image this coordinator cannot build is prepared.
      const auto cached = committed_images_step_ == base ? committed_images_.find(id)
                                                         : committed_images_.end();
      if (cached != committed_images_.end()) {
        ImageMemory memory;
        if (auto spare = spare_images_.find(id); spare != spare_images_.end()) {
          memory.image = std::move(spare->second);
        }
        if (auto known = spare_differs_at_.extract(id)) {
          memory.differs_at = std::move(known.mapped());
        }
        std::string bytes = spare_bytes(id);
        bool unknown_fields = false;
        absl::StatusOr<v1::NodeImage> built =
            PatchedImage(cached->second, kept_bytes(id), proposal.image, *proposal.patch, bytes,
                         std::move(memory), &unknown_fields);
        const absl::Status usable =
            built.ok() ? CheckNodeImage(*built, context_.topology->limits) : built.status();
        if (usable.ok()) {
          held[id] = base;
          images[id] = *std::move(built);
          image_bytes[id] = std::move(bytes);
          if (!unknown_fields) {
            built_on_base[id].assign(proposal.patch->changed().begin(),
                                     proposal.patch->changed().end());
          }
          proposed_patches.emplace(id, ImagePatchOf{*std::move(proposal.patch),
                                                    std::move(proposal.image)});
          continue;
        }
        Log(LogLevel::kWarning, "step ", step, ": node ", id, "'s proposal: ", usable.message(),
            "; it is prepared");
      }
    }
    v1::PrepareRequest request;
    request.set_coordinator(context_.node_id());
    request.set_step(step);
    request.set_timeout_ms(options.commit_timeout_ms);
    request.set_token(token);
    if (base) request.set_base_step(*base);
    prepares.emplace_back(id, std::move(request));
  }
  Log(LogLevel::kDebug, "step ", step, ": prepare ", prepares.size(), " of ", nodes.size(),
      " nodes, the others proposed their images (token ", token, ")");
  if (!prepares.empty()) {
    context_.peers->PrepareEach(
      prepares, [&](uint32_t id, absl::StatusOr<v1::PrepareResponse> response) {
        if (!response.ok()) {
          abort_once(absl::StrCat("node ", id, " did not prepare: ", response.status().message()));
          return;
        }
        if (absl::Status answer = CheckPrepareAnswer(*response, id, step, context_.topology->limits);
            !answer.ok()) {
          abort_once(std::string(answer.message()));
          return;
        }
        if (response->rebuilding()) {
          rebuilding.insert(id);
          if (response->receiver()) receivers.insert(id);
          return;
        }
        images[id] = response->image();
        if (response->has_committed_step()) held[id] = response->committed_step();
        else held[id] = std::nullopt;
      });
  }
  if (failed) return !deposed;
  // Nodes that rebuild are absent too: the step commits without them if it could without them lost.
  if (!rebuilding.empty()) {
    absent.insert(rebuilding.begin(), rebuilding.end());
    if (absl::Status degraded = CheckDegraded({absent.begin(), absent.end()}, base);
        !degraded.ok()) {
      abort_once(std::string(degraded.message()));
      return !deposed;
    }
  }
  // Every node's image is in: the step holds each rank's state, but a replica group's only when
  // every member captured its shard at this step.
  if (absl::Status shards = CheckGroupShards(step, images); !shards.ok()) {
    abort_once(std::string(shards.message()));
    return !deposed;
  }

  Log(LogLevel::kDebug, "step ", step, ": encode against ", base ? absl::StrCat(*base) : "none");
  const std::vector<std::vector<uint32_t>>& groups = context_.topology->groups;
  // The nodes that encode: those that prepared an image, and the parity receivers. Each request
  // of a group carries every member's image as its bytes: the requests live on an arena and
  // borrow the bytes from `image_bytes` and `changes_bytes`, which outlive them, instead of
  // copying them each.
  std::map<uint32_t, std::string> changes_bytes;  // the patches' changes, serialized
  google::protobuf::Arena arena;
  // Each member's image as its changes since the base step, where this coordinator committed the
  // base (and so holds the image every member's record has of it) and the member lists as many
  // regions as then; every other image whole, as the bytes it came as or serialized here.
  std::map<uint32_t, ImagePatchOf> patches = std::move(proposed_patches);
  for (const auto& [id, image] : images) {
    if (patches.contains(id)) continue;
    if (base && committed_images_step_ == base) {
      if (const auto found = committed_images_.find(id); found != committed_images_.end()) {
        std::string bytes = spare_bytes(id);
        if (std::optional<ImagePatchOf> patch =
                PatchOf(found->second, kept_bytes(id), image, bytes)) {
          image_bytes[id] = std::move(bytes);
          patches.emplace(id, *std::move(patch));
          continue;
        }
      }
    }
    if (std::string& bytes = image_bytes[id]; bytes.empty()) ImageBytesInto(image, bytes);
  }
  for (const auto& [id, patched] : patches) ImageBytesInto(patched.changes, changes_bytes[id]);
  std::vector<std::pair<uint32_t, const v1::EncodeRequest*>> encodes;
  for (uint32_t id : nodes) {
    if (absent.contains(id) && !receivers.contains(id)) continue;
    v1::EncodeRequest& request =
        *google::protobuf::Arena::CreateMessage<v1::EncodeRequest>(&arena);
    request.set_coordinator(context_.node_id());
    request.set_step(step);
    request.set_timeout_ms(options.commit_timeout_ms);
    request.set_token(token);
    if (base) request.set_base_step(*base);
    request.set_parity_only(receivers.contains(id));
    // Deltas update the group's committed parity, which exists only when every member holds the
    // same committed step (a node that went back to a durable step holds none).
    const std::vector<uint32_t>& group = groups[options.GroupOf(id)->first];
    std::optional<uint32_t> first_present;
    for (uint32_t member : group) {
      if (absent.contains(member)) continue;
      if (!first_present) first_present = member;
      if (!held[member] || held[member] != held[*first_present]) request.set_whole(true);
    }
    // A receiver builds patched images on its record of the base step, which a whole encode's
    // receivers do not all hold, nor a parity receiver (it reads the record from a member).
    const bool patch = !request.whole() && !request.parity_only();
    for (uint32_t member : group) {
      if (absent.contains(member)) {
        // Frozen at its last committed image, which the receiver's own record holds.
        v1::NodeImage placeholder;
        placeholder.set_node_id(member);
        ImageBytesInto(placeholder, *request.add_group_images());
        request.add_absent_nodes(member);
        if (receivers.contains(member)) request.add_parity_receivers(member);
        continue;
      }
      if (const auto patched = patches.find(member); patch && patched != patches.end()) {
        request.mutable_group_images()->UnsafeArenaAddAllocated(&changes_bytes[member]);
        request.mutable_patches()->UnsafeArenaAddAllocated(&patched->second.patch);
        continue;
      }
      request.mutable_group_images()->UnsafeArenaAddAllocated(&image_bytes[member]);
    }
    if (request.whole() && request.absent_nodes_size() > 0) {
      // A whole encode needs every data unit of a stripe, the absent nodes' too.
      abort_once(absl::StrCat(
          "group ", options.GroupOf(id)->first, " has absent nodes [",
          absl::StrJoin(request.absent_nodes(), ", "), "] and its live nodes do not all hold ",
          "committed step ", base ? absl::StrCat(*base) : "(none)",
          ", so the step cannot go as deltas; it commits once the absent nodes are rebuilt"));
      return !deposed;
    }
    encodes.emplace_back(id, &request);
  }
  uint64_t sent = 0;
  bool delta = true;
  context_.peers->EncodeEach(
      encodes, [&](uint32_t id, absl::StatusOr<v1::EncodeResponse> response) {
        if (!response.ok()) {
          abort_once(absl::StrCat("node ", id, " did not store its parity: ",
                                  response.status().message()));
          return;
        }
        sent += response->bytes_sent();
        if (!response->delta()) delta = false;
      });
  if (failed) return !deposed;

  if (!Decide(step, token, true, "", {absent.begin(), absent.end()})) return false;
  uint64_t bytes = 0;
  for (const auto& [id, image] : images) bytes += image.bytes();
  Log(LogLevel::kInfo, "step ", step, " committed on ", images.size(), " nodes (", bytes,
      " bytes of data, ", sent, delta ? " bytes of changed units" : " bytes of units",
      " sent to parity holders) in ", absl::FormatDuration(absl::Now() - started),
      absent.empty()
          ? ""
          : absl::StrCat("; degraded: nodes [", absl::StrJoin(absent, ", "),
                         "] absent, their data frozen at their last committed image",
                         rebuilding.empty()
                             ? ""
                             : absl::StrCat(" (rebuilding: [", absl::StrJoin(rebuilding, ", "),
                                            "], receiving its parity: [",
                                            absl::StrJoin(receivers, ", "), "])")));
  // The next round patches against this step's images; an absent node's is still its image of the
  // base step.
  if (committed_images_step_ == base) {
    for (uint32_t id : absent) {
      if (auto frozen = committed_images_.find(id); frozen != committed_images_.end()) {
        images[id] = std::move(frozen->second);
      }
      if (auto frozen = committed_image_bytes_.find(id); frozen != committed_image_bytes_.end()) {
        image_bytes[id] = std::move(frozen->second);
      }
    }
  }
  {
    absl::MutexLock lock(&mutex_);
    for (auto& [id, image] : spare_images_) {
      if (image.regions_size() > 0 && image_memory_.size() < nodes.size()) {
        image_memory_.push_back(std::move(image));
      }
    }
  }
  spare_images_ = std::exchange(committed_images_, std::move(images));
  spare_image_bytes_ = std::exchange(committed_image_bytes_, std::move(image_bytes));
  spare_differs_at_ = std::move(built_on_base);
  committed_images_step_ = step;
  return true;
}

}  // namespace moesnap::daemon::cluster
