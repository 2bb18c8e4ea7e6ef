// Rebuilder: pipelined decoding of a node's units from its group, the rebuild at start, repair.
#include "daemon/cluster/rebuild.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/metrics.h"
#include "daemon/cluster/parallel.h"
#include "daemon/cluster/stripe_units.h"
#include "daemon/progress.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon::cluster {
namespace {

// Registered when the program starts, so a scrape sees it at zero before any rebuild.
metrics::Counter& rebuilt_bytes = metrics::Registry::Default().AddCounter(
    "moesnap_rebuild_bytes_total", "Data and parity bytes this node rebuilt from its group");

metrics::Counter& caught_up_steps_total = metrics::Registry::Default().AddCounter(
    "moesnap_rebuild_caught_up_steps_total",
    "Committed steps this node caught up with from the parity it received while it rebuilt");

// Which units decode the unit of position `target` in `stripe`: k of them, virtually zero data
// units first (known without asking anyone), then data, then parity units of holders.
struct StripeSources {
  int target = 0;            // the target's unit index in the stripe
  std::vector<int> chosen;   // k unit indices
  std::vector<int> holding;  // those of `chosen` that hold bytes (fetched from their nodes)
};
absl::StatusOr<StripeSources> ChooseSources(const erasure::StripeLayout& layout,
                                            const std::vector<uint64_t>& sizes,
                                            const std::vector<bool>& holds, uint64_t stripe,
                                            int target) {
  const int k = layout.data_units();
  const int n = layout.group_size();
  StripeSources sources;
  std::vector<int> zeros, data, parity;
  for (int i = 0; i < n; ++i) {
    const int position = PositionOf(layout, stripe, i);
    if (position == target) {
      sources.target = i;
    } else if (i < k && UnitBytes(layout, sizes, stripe, i, 0) == 0) {
      zeros.push_back(i);
    } else if (holds[position]) {
      (i < k ? data : parity).push_back(i);
    }
  }
  for (const std::vector<int>* list : {&zeros, &data, &parity}) {
    for (int i : *list) {
      if (static_cast<int>(sources.chosen.size()) == k) break;
      sources.chosen.push_back(i);
      if (list != &zeros) sources.holding.push_back(i);
    }
  }
  if (static_cast<int>(sources.chosen.size()) < k) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stripe ", stripe, " has ", sources.chosen.size(), " of the ", k, " units it needs"));
  }
  return sources;
}

// Each stripe's target unit is decoded by a helper, one of the stripe's sources holding bytes (they
// take turns stripe by stripe), which fetches the other k - 1 and sends back the one unit: the
// decoding node's link carries one unit per stripe, not k (repair at a helper). A helper's stripes
// go in requests of at most `helper_bound` bytes at the helper (one stripe at least).
struct DecodeWork {
  uint64_t stripe = 0;
  uint64_t length = 0;
  int mine = 0;                  // the target's unit index in the stripe
  uint64_t bytes = 0;            // of the target's unit
  std::vector<int> chosen;       // the k units the helper decodes it from
  ParityUnit* parity = nullptr;  // where a decoded parity unit goes (null: none kept)
  // Where the unit is received when it goes straight into the target (DecodeTarget::fresh_image),
  // else null (received in scratch).
  uint8_t* in_place = nullptr;
};
struct HelperRequest {
  std::vector<DecodeWork> works;
  uint64_t helper_bytes = 0;    // what the helper decodes in (HelperStripeBytes)
  uint64_t received_bytes = 0;  // what comes back into scratch: one unit a stripe not in place
};
struct DecodePlan {
  std::map<uint32_t, std::vector<HelperRequest>> requests_of;  // by helper node, in order
  std::vector<DecodeWork> unhelped;  // nothing to fetch: the unit is empty, or its sources are
  uint64_t fetched_bytes = 0;        // what the helpers send back
};
absl::StatusOr<DecodePlan> PlanDecode(const Topology& topology, const DecodeTarget& target,
                                      const std::vector<uint64_t>& stripes,
                                      const std::vector<uint64_t>& sizes,
                                      const std::vector<bool>& holds, uint64_t helper_bound) {
  const erasure::StripeLayout& layout = topology.layout;
  const int k = layout.data_units();
  const int n = layout.group_size();
  const int64_t step = target.record.committed_step();
  DecodePlan plan;
  for (uint64_t stripe : stripes) {
    DecodeWork work;
    work.stripe = stripe;
    work.length = layout.ParityLength(stripe, sizes);
    if (work.length == 0) continue;
    absl::StatusOr<StripeSources> sources =
        ChooseSources(layout, sizes, holds, stripe, target.position);
    if (!sources.ok()) {
      std::vector<uint32_t> lost;
      for (int position = 0; position < n; ++position) {
        if (!holds[position]) lost.push_back(topology.NodeAt(target.group, position));
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "group ", target.group, " [", absl::StrJoin(topology.groups[target.group], ", "),
          "] has lost nodes [", absl::StrJoin(lost, ", "), "]: more than m = ", n - k, " of its ",
          n, " nodes, so step ", step, " of node ", topology.NodeAt(target.group, target.position),
          " can no longer be recovered (", sources.status().message(), ")"));
    }
    work.mine = sources->target;
    work.bytes = UnitBytes(layout, sizes, stripe, work.mine, work.length);
    work.chosen = sources->chosen;
    if (work.mine >= k && target.parity != nullptr) {
      auto unit = target.parity->find(stripe);
      if (unit == target.parity->end() || unit->second.extent == nullptr ||
          unit->second.bytes < work.length) {
        return absl::InternalError(absl::StrCat("no parity unit of stripe ", stripe, " (",
                                                work.length, " bytes) to decode into"));
      }
      work.parity = &unit->second;
    }
    if (sources->holding.empty() || work.bytes == 0) {
      plan.unhelped.push_back(std::move(work));
      continue;
    }
    if (target.fresh_image != nullptr && work.parity != nullptr) {
      work.in_place = work.parity->extent->data();
    } else if (target.fresh_image != nullptr && work.mine < k) {
      work.in_place = target.fresh_image->Contiguous(
          layout.DataUnitOf(target.position, stripe) * layout.unit_bytes(), work.bytes);
    }
    const int helper = sources->holding[stripe % sources->holding.size()];
    std::vector<HelperRequest>& requests =
        plan.requests_of[topology.NodeAt(target.group, PositionOf(layout, stripe, helper))];
    const uint64_t helper_bytes = HelperStripeBytes(layout, work.length);
    if (requests.empty() || requests.back().helper_bytes + helper_bytes > helper_bound) {
      requests.emplace_back();
    }
    requests.back().helper_bytes += helper_bytes;
    if (work.in_place == nullptr) requests.back().received_bytes += work.length;
    plan.fetched_bytes += work.bytes;
    requests.back().works.push_back(std::move(work));
  }
  return plan;
}

}  // namespace

Rebuilder::Rebuilder(const ClusterContext& context, ClusterStore* store, ParityStore* parity,
                     Transfer* transfer, Pool* pool, DecisionLog* log,
                     const RebuildOptions& options)
    : context_(context), store_(store), parity_(parity), transfer_(transfer), pool_(pool),
      log_(log), options_(options),
      helper_(context, store, transfer, options.helper_request_bytes) {}

Rebuilder::~Rebuilder() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    changed_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

void Rebuilder::Start() {
  thread_ = std::thread([this] { Run(); });
}

void Rebuilder::NoteBehind(int64_t step) {
  absl::MutexLock lock(&mutex_);
  if (ReplacedLocked(step)) return;
  behind_ = true;
  wanted_ = true;
  if (!target_ || *target_ < step) target_ = step;
  changed_.SignalAll();
}

int Rebuilder::CatchUpLocked() {
  int steps = 0;
  while (std::optional<std::pair<int64_t, std::vector<v1::NodeImage>>> next =
             parity_->NextAccumulated()) {
    const int64_t step = next->first;
    absl::StatusOr<std::vector<v1::JournalParity>> parity = parity_->FoldAccumulated(step);
    if (!parity.ok()) {
      Log(LogLevel::kWarning, "node ", context_.node_id(), " cannot catch up with step ", step,
          ": ", parity.status().message());
      break;
    }
    v1::JournalCluster record;
    record.set_committed_step(step);
    for (v1::NodeImage& image : next->second) *record.add_group_images() = std::move(image);
    for (v1::JournalParity& unit : *parity) *record.add_parity() = std::move(unit);
    if (absl::Status status = store_->InstallImage(store_->CommittedImage(), record);
        !status.ok()) {
      Log(LogLevel::kWarning, "node ", context_.node_id(), " cannot catch up with step ", step,
          ": ", status.message());
      break;
    }
    parity_->Commit(step);
    ++steps;
    ++caught_up_steps_;
    caught_up_steps_total.Add();
  }
  if (steps > 0) {
    Log(LogLevel::kInfo, "node ", context_.node_id(), " caught up with ", steps,
        " committed step", steps > 1 ? "s" : "", " from the parity it received, to step ",
        store_->ClusterRecord()->committed_step());
  }
  return steps;
}

void Rebuilder::HoldInstall(int64_t until) {
  Log(LogLevel::kWarning, "fault injection: the rebuild installs once step ", until,
      " or a later one is committed");
  while (true) {
    absl::StatusOr<std::vector<v1::StepDecision>> decisions = log_->DecisionsAfter(until - 1);
    if (decisions.ok()) {
      for (const v1::StepDecision& decision : *decisions) {
        if (decision.committed()) return;
      }
    }
    absl::MutexLock lock(&mutex_);
    if (stopping_) return;
    changed_.WaitWithTimeout(&mutex_, options_.retry_interval);
  }
}

std::vector<absl::StatusOr<v1::GroupStateResponse>> Rebuilder::GroupStates(int group,
                                                                            int excluded) {
  const int size = context_.layout().group_size();
  std::vector<int> positions(size);
  for (int position = 0; position < size; ++position) positions[position] = position;
  std::vector<absl::StatusOr<v1::GroupStateResponse>> states(
      size, absl::NotFoundError("not asked"));
  InParallel(positions, [&](int position) -> absl::Status {
    if (position != excluded) {
      states[position] = context_.peers->GroupState(context_.topology->NodeAt(group, position));
    }
    return absl::OkStatus();
  });
  return states;
}

std::vector<bool> Rebuilder::HoldersIn(
    const std::vector<absl::StatusOr<v1::GroupStateResponse>>& states, int64_t step) {
  std::vector<bool> holds;
  for (const absl::StatusOr<v1::GroupStateResponse>& state : states) {
    holds.push_back(state.ok() && !state->rebuilding() && state->cluster().has_committed_step() &&
                    state->cluster().committed_step() == step);
  }
  return holds;
}

absl::Status Rebuilder::Decode(const DecodeTarget& target, const std::vector<uint64_t>& stripes,
                               v1::RebuildResponse* stats) {
  absl::MutexLock lock(&decode_mutex_);
  return DecodeLocked(target, stripes, stats);
}

absl::Status Rebuilder::DecodeLocked(const DecodeTarget& target,
                                     const std::vector<uint64_t>& stripes,
                                     v1::RebuildResponse* stats) {
  const erasure::StripeLayout& layout = context_.layout();
  const Topology& topology = *context_.topology;
  const int k = layout.data_units();
  const int64_t step = target.record.committed_step();
  OperationProgress progress = ProgressBoard::Default().Begin("rebuild", stripes.size(), "stripes");
  const std::vector<uint64_t> sizes = ImageSizes(target.record);
  // Asked now, not taken from what membership last heard: a peer may have committed since.
  const std::vector<bool> holds =
      target.holders.empty() ? HoldersIn(GroupStates(target.group, target.position), step)
                             : target.holders;

  absl::StatusOr<DecodePlan> plan =
      PlanDecode(topology, target, stripes, sizes, holds,
                 HelperRequestBound(layout, options_.helper_request_bytes));
  if (!plan.ok()) return plan.status();
  stats->set_fetched_bytes(stats->fetched_bytes() + plan->fetched_bytes);
  const std::map<uint32_t, std::vector<HelperRequest>>& requests_of = plan->requests_of;
  const std::vector<DecodeWork>& unhelped = plan->unhelped;

  absl::Mutex stats_mutex;
  // Writes a decoded unit where the target wants it, unless it was received there; called from
  // each helper's thread.
  auto finish = [&](const DecodeWork& work, const uint8_t* unit) {
    const bool landed = unit == work.in_place;
    uint64_t data_bytes = 0;
    uint64_t parity_bytes = 0;
    if (landed) in_place_bytes_ += work.bytes;
    if (work.mine < k) {
      if (!landed) {
        target.write_data(layout.DataUnitOf(target.position, work.stripe), unit, work.bytes);
      }
      data_bytes = work.bytes;
    } else if (work.parity != nullptr) {
      if (!landed) std::memcpy(work.parity->extent->data(), unit, work.length);
      work.parity->crc = erasure::Crc32c(work.parity->extent->data(), work.length);
      parity_bytes = work.length;
    }
    rebuilt_bytes.Add(data_bytes + parity_bytes);
    progress.Advance(1);
    absl::MutexLock lock(&stats_mutex);
    stats->set_data_bytes(stats->data_bytes() + data_bytes);
    stats->set_parity_bytes(stats->parity_bytes() + parity_bytes);
    stats->set_stripes(stats->stripes() + 1);
  };
  if (!unhelped.empty()) {  // zeros: their sources are virtually zero, or they are empty
    const std::vector<uint8_t> zeros(layout.unit_bytes());
    for (const DecodeWork& work : unhelped) finish(work, zeros.data());
  }

  // What each helper's answers land in when they cannot land in place, one request's worth each:
  // from the pool when it has room (its pages are resident, so no page faults), else the heap.
  struct Helper {
    uint32_t node = 0;
    uint64_t offset = 0;  // where its answers land in scratch
  };
  std::vector<Helper> helpers;
  uint64_t scratch_bytes = 0;
  for (const auto& [node, requests] : requests_of) {
    helpers.push_back({node, scratch_bytes});
    uint64_t largest = 0;
    for (const HelperRequest& request : requests) {
      largest = std::max(largest, request.received_bytes);
    }
    scratch_bytes += largest;
  }
  std::shared_ptr<PoolExtent> pool_scratch;
  std::vector<uint8_t> heap_scratch;
  uint8_t* scratch = nullptr;
  if (scratch_bytes > 0) {
    if (absl::StatusOr<std::shared_ptr<PoolExtent>> extent = pool_->Allocate(scratch_bytes);
        extent.ok()) {
      pool_scratch = *std::move(extent);
      scratch = pool_scratch->data();
    } else {
      heap_scratch.resize(scratch_bytes);
      scratch = heap_scratch.data();
    }
  }
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> helper_fetched{0};
  // Each helper is sent its next request as soon as it has answered the last: no helper idles
  // while the slowest finishes.
  const std::vector<absl::Status> helped = InParallel(helpers, [&](const Helper& helper) {
    const uint32_t node = helper.node;
    uint8_t* const received = scratch + helper.offset;
    for (const HelperRequest& request : requests_of.at(node)) {
      if (failed) return absl::OkStatus();  // another helper's failure is the one reported
      v1::DecodeUnitsRequest call;
      call.set_to_node(context_.node_id());
      call.set_step(step);
      call.set_request(transfer_->NewRequest());
      std::vector<std::pair<FetchKey, FetchSlot>> slots;
      // Where each unit lands: in place, or the next unit of scratch.
      std::vector<uint8_t*> lands;
      uint64_t offset = 0;
      for (const DecodeWork& work : request.works) {
        v1::DecodeStripe* stripe = call.add_stripes();
        stripe->set_stripe(work.stripe);
        stripe->set_target(static_cast<uint32_t>(work.mine));
        for (int i : work.chosen) stripe->add_sources(static_cast<uint32_t>(i));
        if (work.in_place != nullptr) {
          lands.push_back(work.in_place);
        } else {
          lands.push_back(received + offset);
          offset += work.length;
        }
        // Data in place is checked by the target's chunk CRCs once the image is whole.
        slots.push_back({{step, work.stripe, static_cast<uint32_t>(work.mine), node, "",
                          call.request()},
                         {lands.back(), work.bytes, node,
                          work.in_place != nullptr && work.mine < k}});
      }
      if (absl::Status fetched = FetchFrom(
              transfer_, slots, std::map<uint32_t, v1::DecodeUnitsRequest>{{node, call}},
              [&](uint32_t id, const v1::DecodeUnitsRequest& asked) -> absl::Status {
                absl::StatusOr<v1::DecodeUnitsResponse> response =
                    context_.peers->DecodeUnits(id, asked);
                if (!response.ok()) return response.status();
                helper_fetched += response->fetched_bytes();
                return absl::OkStatus();
              });
          !fetched.ok()) {
        failed = true;
        return fetched;
      }
      for (size_t i = 0; i < request.works.size(); ++i) finish(request.works[i], lands[i]);
    }
    return absl::OkStatus();
  });
  stats->set_helper_fetched_bytes(stats->helper_fetched_bytes() + helper_fetched.load());
  for (const absl::Status& status : helped) {
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::DecodeUnitsResponse> Rebuilder::DecodeFor(
    const v1::DecodeUnitsRequest& request, const std::function<bool()>& cancelled) {
  return helper_.DecodeFor(request, cancelled);
}

absl::StatusOr<v1::RebuildResponse> Rebuilder::RebuildSelf(bool force,
                                                         std::optional<int64_t> target) {
  absl::MutexLock decode_lock(&decode_mutex_);
  const erasure::StripeLayout& layout = context_.layout();
  const Topology& topology = *context_.topology;
  const uint32_t self = context_.node_id();
  const int position = topology.position;
  const absl::Time started = absl::Now();
  // The group's record of its latest committed step, from the members that hold it.
  std::optional<v1::JournalCluster> record;
  // The members that lost the target step: this node, those that hold no committed step (fresh
  // memory, or a step loaded from the durable tier), and those that rebuild and hold an older one.
  // A member that holds an older step without rebuilding is only applying the decision late.
  std::vector<uint32_t> lost = {self};
  const std::vector<absl::StatusOr<v1::GroupStateResponse>> states =
      GroupStates(topology.group, position);
  for (int member = 0; member < layout.group_size(); ++member) {
    const uint32_t id = topology.NodeAt(topology.group, member);
    const absl::StatusOr<v1::GroupStateResponse>& response = states[member];
    if (!response.ok()) continue;
    const v1::JournalCluster& held = response->cluster();
    if (absl::Status checked =
            CheckGroupRecord(held, topology.groups[topology.group], topology.limits);
        !checked.ok()) {
      Log(LogLevel::kWarning, "node ", id, "'s group record is not used: ", checked.message());
      continue;
    }
    if (target && (!held.has_committed_step() ||
                   (response->rebuilding() && held.committed_step() < *target))) {
      lost.push_back(id);
    }
    if (response->rebuilding() || !held.has_committed_step()) continue;
    if (!record || held.committed_step() > record->committed_step()) record = held;
  }
  const std::shared_ptr<const v1::JournalCluster> mine = store_->ClusterRecord();
  v1::RebuildResponse stats;
  if (target && (!record || record->committed_step() < *target)) {
    if (lost.size() > static_cast<size_t>(layout.group_size() - layout.data_units())) {
      // Fewer than k members can ever hold it: memory cannot bring the step back.
      return absl::DataLossError(absl::StrCat(
          "step ", *target, " is lost in group ", topology.group, ": nodes [",
          absl::StrJoin(lost, ", "), "] do not hold it and at most ",
          layout.group_size() - layout.data_units(), " may be lost"));
    }
    return absl::UnavailableError(absl::StrCat(
        "no live member of group ", topology.group, " holds step ", *target,
        " yet (the latest committed), so node ", self, " cannot rebuild it now",
        record ? absl::StrCat("; the newest a member holds is step ", record->committed_step())
               : ""));
  }
  if (!record || (mine->has_committed_step() &&
                  mine->committed_step() >= record->committed_step() && !force)) {
    if (mine->has_committed_step()) stats.set_step(mine->committed_step());
    return stats;  // nothing newer in the group: this node is current
  }
  const int64_t step = record->committed_step();
  stats.set_step(step);
  if (record->group_images_size() != layout.group_size() ||
      record->group_images(position).node_id() != self) {
    return absl::DataLossError(absl::StrCat("the group's record of step ", step,
                                            " does not list node ", self, " at position ",
                                            position));
  }
  Log(LogLevel::kInfo, "rebuilding node ", self, "'s step ", step, " (",
      record->group_images(position).bytes(), " bytes of data) from group ", topology.group);
  absl::StatusOr<NodeImage> image = NodeImage::Allocate(pool_, record->group_images(position));
  if (!image.ok()) return image.status();
  std::vector<uint64_t> sizes;
  for (const v1::NodeImage& member : record->group_images()) sizes.push_back(member.bytes());
  std::map<uint64_t, ParityUnit> parity;
  std::vector<uint64_t> stripes;
  const uint64_t stripe_count = layout.StripeCount(sizes);
  for (uint64_t stripe = 0; stripe < stripe_count; ++stripe) {
    if (layout.IsParityPosition(stripe, position)) {
      const uint64_t bytes = layout.ParityLength(stripe, sizes);
      if (bytes == 0) continue;
      absl::StatusOr<std::shared_ptr<PoolExtent>> extent = pool_->Allocate(bytes);
      if (!extent.ok()) return extent.status();
      parity[stripe] = {stripe, bytes, 0, *std::move(extent)};
    } else if (layout.UnitLength(sizes[position], layout.DataUnitOf(position, stripe)) == 0) {
      continue;
    }
    stripes.push_back(stripe);
  }
  const NodeImage& rebuilt = *image;
  DecodeTarget decode{*record, topology.group, position,
                      [&](uint64_t unit, const uint8_t* bytes, uint64_t length) {
                        rebuilt.Write(unit * layout.unit_bytes(), bytes, length);
                      },
                      &parity, &rebuilt, HoldersIn(states, step)};
  if (absl::Status status = DecodeLocked(decode, stripes, &stats); !status.ok()) return status;
  if (std::vector<std::pair<int, uint32_t>> corrupt = image->CorruptChunks(); !corrupt.empty()) {
    const v1::ImageRegion& region = image->manifest().regions(corrupt[0].first);
    return absl::DataLossError(absl::StrCat(
        "rebuilt data of step ", step, " fails ", corrupt.size(), " chunk CRCs (first: region '",
        region.region(), "' of rank ", region.rank(), ", chunk ", corrupt[0].second,
        "): a survivor's units, or the bytes sent from them, are corrupt"));
  }
  if (options_.hold_install_steps) HoldInstall(step + *options_.hold_install_steps);
  v1::JournalCluster installed = *record;
  installed.clear_parity();
  std::vector<ParityUnit> units;
  for (auto& [stripe, unit] : parity) {
    *installed.add_parity() = ParityStore::RecordOf(unit);
    units.push_back(unit);
  }
  if (absl::Status status = store_->InstallImage(*image, installed); !status.ok()) return status;
  parity_->Install(step, std::move(units));
  // Steps committed during the decode whose parity this node received follow at once.
  if (CatchUpLocked() > 0) stats.set_step(store_->ClusterRecord()->committed_step());
  stats.set_seconds(absl::ToDoubleSeconds(absl::Now() - started));
  Log(LogLevel::kInfo, LogFields{.step = step, .duration_seconds = stats.seconds()},
      "rebuilt step ", step, ": ", stats.stripes(), " stripes, ", stats.data_bytes(),
      " bytes of data and ", stats.parity_bytes(), " of parity from ", stats.fetched_bytes(),
      " received (its helpers fetched ", stats.helper_fetched_bytes(), "), in ", stats.seconds(),
      " s");
  return stats;
}

void Rebuilder::Run() {
  absl::Duration backoff = options_.retry_interval;
  while (true) {
    std::optional<int64_t> noted;
    {
      absl::MutexLock lock(&mutex_);
      while (!wanted_ && !stopping_) changed_.Wait(&mutex_);
      if (stopping_) return;
      wanted_ = false;
      noted = target_;
    }
    {
      absl::MutexLock decode_lock(&decode_mutex_);
      CatchUpLocked();
    }
    // The latest committed step is what etcd holds, whatever the group has applied so far.
    const std::shared_ptr<const v1::JournalCluster> mine = store_->ClusterRecord();
    const std::optional<int64_t> committed =
        mine->has_committed_step() ? std::optional<int64_t>(mine->committed_step()) : std::nullopt;
    absl::StatusOr<std::vector<v1::StepDecision>> newer = log_->DecisionsAfter(committed);
    std::optional<int64_t> target = noted;
    absl::Status status = newer.status();
    if (newer.ok()) {
      for (const v1::StepDecision& decision : *newer) {
        if (decision.committed() && (!target || decision.step() > *target)) target = decision.step();
      }
      if (target && committed && *committed >= *target) target.reset();
      if (target) {
        absl::MutexLock lock(&mutex_);
        if (ReplacedLocked(*target)) target.reset();
      }
      if (target) {
        {
          absl::MutexLock lock(&mutex_);
          behind_ = true;
          target_ = target;
          // Known to be behind: Prepare answers at once (absent, or refusing) instead of waiting.
          checked_ = true;
          changed_.SignalAll();
        }
        Log(LogLevel::kInfo, "node ", context_.node_id(), " holds ",
            committed ? absl::StrCat("step ", *committed) : "no step", "; the group committed step ",
            *target, ": rebuilding");
        status = RebuildSelf(/*force=*/false, target).status();
      }
    }
    absl::MutexLock lock(&mutex_);
    // A step committed meanwhile without this node (it was told so) is looked at first: a Prepare
    // must not find this node current while it is not.
    if (status.ok() && wanted_ && !stopping_) continue;
    // State loaded from the durable tier meanwhile answers for the target.
    if (status.ok() || (target && ReplacedLocked(*target))) {
      checked_ = true;
      behind_ = false;
      target_.reset();
      failure_ = absl::OkStatus();
      backoff = options_.retry_interval;
      changed_.SignalAll();
      continue;
    }
    // A peer restarting, a group that has not applied the step yet, etcd out of reach, or too few
    // survivors: reported, and tried again until it works.
    checked_ = checked_ || newer.ok();
    failure_ = status;
    wanted_ = true;
    changed_.SignalAll();
    Log(LogLevel::kWarning, "rebuild of node ", context_.node_id(), " failed, trying again in ",
        absl::FormatDuration(backoff), ": ", status.ToString());
    const absl::Time retry = absl::Now() + backoff;
    while (!stopping_ && !changed_.WaitWithDeadline(&mutex_, retry)) {
    }
    backoff = std::min(backoff * 2, options_.max_retry_interval);
  }
}

absl::StatusOr<v1::RebuildResponse> Rebuilder::RebuildNode(uint32_t node_id) {
  if (node_id != context_.node_id()) {
    if (!context_.options().GroupOf(node_id)) {
      return absl::NotFoundError(absl::StrCat("node ", node_id, " is not in the cluster"));
    }
    return context_.peers->Rebuild(node_id);
  }
  return RebuildHere();
}

absl::StatusOr<v1::RebuildResponse> Rebuilder::RebuildHere() {
  absl::StatusOr<v1::RebuildResponse> rebuilt = RebuildSelf(/*force=*/true, std::nullopt);
  absl::MutexLock lock(&mutex_);
  if (rebuilt.ok()) {
    behind_ = false;
    target_.reset();
    failure_ = absl::OkStatus();
  } else {
    // A node that held its data still does: the failure is reported, the data stays restorable.
    failure_ = rebuilt.status();
  }
  changed_.SignalAll();
  return rebuilt;
}

absl::Status Rebuilder::WaitRestorable(absl::Time deadline) const {
  absl::MutexLock lock(&mutex_);
  // Until the first check, and while a rebuild runs that has not failed yet.
  while (!checked_ || (behind_ && failure_.ok())) {
    if (stopping_ || changed_.WaitWithDeadline(&mutex_, deadline)) {
      return absl::UnavailableError(absl::StrCat(
          "node ", context_.node_id(), " is still ",
          checked_ ? absl::StrCat("rebuilding", target_ ? absl::StrCat(" step ", *target_) : "",
                                  " from group ", context_.topology->group)
                   : "checking whether it holds the latest committed step (is etcd reachable?)",
          "; retry"));
    }
  }
  return behind_ ? failure_ : absl::OkStatus();
}

void Rebuilder::StateReplaced() {
  // The steps committed so far belong to the run the job went back from.
  std::optional<int64_t> latest;
  if (absl::StatusOr<std::vector<v1::StepDecision>> decisions = log_->DecisionsAfter(std::nullopt);
      decisions.ok()) {
    for (const v1::StepDecision& decision : *decisions) {
      if (decision.committed()) latest = std::max(latest.value_or(decision.step()), decision.step());
    }
  }
  absl::MutexLock lock(&mutex_);
  if (target_) latest = std::max(latest.value_or(*target_), *target_);
  if (!latest || ReplacedLocked(*latest)) return;
  Log(LogLevel::kInfo, "node ", context_.node_id(), " holds a step loaded from the durable tier; ",
      "the steps committed through step ", *latest, " no longer need rebuilding",
      failure_.ok() ? "" : absl::StrCat(" (the last rebuild failed: ", failure_.message(), ")"));
  replaced_through_ = latest;
  checked_ = true;
  behind_ = false;
  wanted_ = false;
  target_.reset();
  failure_ = absl::OkStatus();
  changed_.SignalAll();
}

std::optional<int64_t> Rebuilder::replaced_through() const {
  absl::MutexLock lock(&mutex_);
  return replaced_through_;
}

bool Rebuilder::ReplacedLocked(int64_t step) const {
  return replaced_through_ && step <= *replaced_through_;
}

bool Rebuilder::rebuilding() const {
  absl::MutexLock lock(&mutex_);
  return !checked_ || (behind_ && failure_.ok());
}

bool Rebuilder::behind() const {
  absl::MutexLock lock(&mutex_);
  return !checked_ || behind_;
}

bool Rebuilder::BehindAfterCheck(absl::Time deadline) const {
  absl::MutexLock lock(&mutex_);
  while (!checked_ && !stopping_) {
    if (changed_.WaitWithDeadline(&mutex_, deadline)) break;
  }
  return !checked_ || behind_;
}

absl::Status Rebuilder::last_failure() const {
  absl::MutexLock lock(&mutex_);
  return failure_;
}

v1::GroupStateResponse Rebuilder::GroupState() const {
  v1::GroupStateResponse response;
  v1::JournalCluster* record = response.mutable_cluster();
  *record = *store_->ClusterRecord();
  record->clear_parity();
  response.set_rebuilding(behind());
  return response;
}

absl::StatusOr<v1::VerifyResponse> Rebuilder::Verify(std::optional<int64_t> step, bool repair) {
  const erasure::StripeLayout& layout = context_.layout();
  const Topology& topology = *context_.topology;
  // Counts the parity units checked and corrupt into `out`; returns the stripes of the corrupt ones.
  auto check_parity = [this](v1::VerifyResponse& out) {
    std::set<uint64_t> corrupt;
    for (const ParityUnit& unit : parity_->CommittedUnits()) {
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
  absl::MutexLock decode_lock(&decode_mutex_);
  const std::shared_ptr<const v1::JournalCluster> held = store_->ClusterRecord();
  const v1::JournalCluster& record = *held;
  const NodeImage image = store_->CommittedImage();
  if (!record.has_committed_step() || record.group_images_size() != layout.group_size()) {
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
    for (uint64_t unit = begin / layout.unit_bytes();
         unit <= (begin + bytes - 1) / layout.unit_bytes(); ++unit) {
      stripes.insert(layout.DataUnitLocation(topology.position, unit).stripe);
    }
  }
  std::map<uint64_t, ParityUnit> parity;
  for (const ParityUnit& unit : parity_->CommittedUnits()) parity[unit.stripe] = unit;
  v1::RebuildResponse stats;
  DecodeTarget target{record, topology.group, topology.position,
                      [&](uint64_t unit, const uint8_t* bytes, uint64_t length) {
                        image.Write(unit * layout.unit_bytes(), bytes, length);
                      },
                      &parity};
  if (absl::Status status = DecodeLocked(target, {stripes.begin(), stripes.end()}, &stats);
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
      result.parity_units_repaired(), " parity units rebuilt from group ", topology.group);
  return result;
}

}  // namespace moesnap::daemon::cluster
