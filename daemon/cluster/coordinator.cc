// Coordinator: proposals, rounds, and finishing steps a lost coordinator left open.
#include "daemon/cluster/coordinator.h"

#include <signal.h>

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "daemon/cluster/parallel.h"

namespace moesnap::daemon::cluster {

Coordinator::Coordinator(const ClusterContext& context, const Membership* membership,
                         const Participant* local)
    : context_(context), membership_(membership), local_(local) {}

Coordinator::~Coordinator() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    changed_.SignalAll();
  }
  if (loop_.joinable()) loop_.join();
}

void Coordinator::Start() {
  loop_ = std::thread([this] { Loop(); });
}

absl::StatusOr<v1::ProposeResponse> Coordinator::Propose(const v1::ProposeRequest& request) {
  const uint32_t coordinator = membership_->Coordinator();
  if (coordinator != context_.node_id()) {
    return absl::FailedPreconditionError(absl::StrCat("node ", coordinator, " is the coordinator"));
  }
  v1::ProposeResponse response;
  absl::MutexLock lock(&mutex_);
  if (!last_round_ || request.step() > *last_round_) {
    proposed_.insert(request.step());
  } else if (request.step() != running_round_) {
    response.set_decided(true);
  }
  changed_.SignalAll();
  return response;
}

void Coordinator::Loop() {
  const absl::Duration poll = HeartbeatInterval(context_.options());
  while (true) {
    std::optional<int64_t> step;
    {
      absl::MutexLock lock(&mutex_);
      if (stopping_) return;
      if (proposed_.empty()) changed_.WaitWithTimeout(&mutex_, poll);
      if (stopping_) return;
      // Lock order: this unit's mutex, then the node table's (which calls nothing back).
      if (membership_->Coordinator() == context_.node_id() && !proposed_.empty()) {
        step = *proposed_.begin();
        proposed_.erase(proposed_.begin());
        last_round_ = step;
        running_round_ = step;
      }
    }
    if (membership_->Coordinator() == context_.node_id()) ResolveOrphans();
    if (step) RunRound(*step);
    absl::MutexLock lock(&mutex_);
    running_round_.reset();
  }
}

absl::Status Coordinator::SendCommit(uint32_t id, int64_t step) {
  v1::CommitRequest request;
  request.set_coordinator(context_.node_id());
  request.set_step(step);
  return context_.peers->Commit(id, request);
}

absl::Status Coordinator::SendAbort(uint32_t id, int64_t step, const std::string& reason) {
  v1::AbortRequest request;
  request.set_coordinator(context_.node_id());
  request.set_step(step);
  request.set_reason(reason);
  return context_.peers->Abort(id, request);
}

void Coordinator::RunRound(int64_t step) {
  const ClusterOptions& options = context_.options();
  const std::vector<uint32_t> nodes = context_.nodes->Ids();
  const absl::Time started = absl::Now();
  auto abort = [&](const std::string& reason) {
    Log(LogLevel::kWarning, "step ", step, " aborted: ", reason);
    InParallel(nodes, [&](uint32_t id) { return SendAbort(id, step, reason); });
  };
  for (uint32_t id : nodes) {
    if (!context_.nodes->Live(id)) {
      abort(absl::StrCat("node ", id, " of group ", options.GroupOf(id)->first,
                         " is lost; snapshots need every node of every group (rebuild it with a "
                         "replacement daemon started with its id)"));
      return;
    }
  }

  Log(LogLevel::kDebug, "step ", step, ": prepare");
  // Phase 1a: every node captured the step.
  std::map<uint32_t, v1::NodeImage> images;
  std::map<uint32_t, std::optional<int64_t>> held;  // the committed step each node holds
  absl::Mutex images_mutex;
  std::vector<absl::Status> prepared = InParallel(nodes, [&](uint32_t id) -> absl::Status {
    v1::PrepareRequest request;
    request.set_coordinator(context_.node_id());
    request.set_step(step);
    request.set_timeout_ms(options.commit_timeout_ms);
    absl::StatusOr<v1::PrepareResponse> response = context_.peers->Prepare(id, request);
    if (!response.ok()) return response.status();
    absl::MutexLock lock(&images_mutex);
    images[id] = response->image();
    if (response->has_committed_step()) held[id] = response->committed_step();
    else held[id] = std::nullopt;
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
  const std::vector<std::vector<uint32_t>>& groups = context_.topology->groups;
  std::atomic<uint64_t> sent{0};
  std::atomic<bool> delta{true};
  std::vector<absl::Status> encoded = InParallel(nodes, [&](uint32_t id) -> absl::Status {
    v1::EncodeRequest request;
    request.set_coordinator(context_.node_id());
    request.set_step(step);
    request.set_timeout_ms(options.commit_timeout_ms);
    // Deltas update the group's committed parity, which exists only when every member holds the
    // same committed step.
    const std::vector<uint32_t>& group = groups[options.GroupOf(id)->first];
    for (uint32_t member : group) {
      *request.add_group_images() = images[member];
      if (!held[member] || held[member] != held[group.front()]) {
        request.set_whole(true);
      }
    }
    absl::StatusOr<v1::EncodeResponse> response = context_.peers->Encode(id, request);
    if (!response.ok()) return response.status();
    sent += response->bytes_sent();
    if (!response->delta()) delta = false;
    return absl::OkStatus();
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

void Coordinator::ResolveOrphans() {
  std::set<int64_t> orphans;
  for (uint32_t id : context_.nodes->LiveIds()) {
    if (id == context_.node_id()) continue;
    const std::optional<NodeView> peer = context_.nodes->View(id);
    if (!peer || !peer->report.has_open_step()) continue;
    const uint32_t owner = peer->report.open_step_coordinator();
    if (owner != context_.node_id() && !context_.nodes->Live(owner)) {
      orphans.insert(peer->report.open_step());
    }
  }
  for (const OpenStepView& open : local_->OpenSteps()) {
    if (open.coordinator != context_.node_id() && !context_.nodes->Live(open.coordinator)) {
      orphans.insert(open.step);
    }
  }
  {
    // Heartbeats report an open step until the next one after its resolution.
    absl::MutexLock lock(&mutex_);
    for (int64_t step : resolved_orphans_) orphans.erase(step);
  }
  const std::vector<uint32_t> nodes = context_.nodes->LiveIds();
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
      absl::StatusOr<v1::StepOutcomeResponse> response = context_.peers->StepOutcome(id, request);
      if (response.ok() && response->state() == v1::STEP_STATE_COMMITTED) any_committed = true;
      if (!response.ok() || (response->state() != v1::STEP_STATE_COMMITTED &&
                             response->state() != v1::STEP_STATE_ENCODED)) {
        all_encoded = false;
      }
      return response.status();
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
    if (std::all_of(statuses.begin(), statuses.end(),
                    [](const absl::Status& status) { return status.ok(); })) {
      absl::MutexLock lock(&mutex_);
      resolved_orphans_.insert(step);
    }
  }
}

}  // namespace moesnap::daemon::cluster
