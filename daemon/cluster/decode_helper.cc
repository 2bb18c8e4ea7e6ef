// DecodeHelper: a group member decoding a stripe's unit for a rebuilding node.
#include "daemon/cluster/decode_helper.h"

#include <cstring>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/cluster/stripe_units.h"

namespace moesnap::daemon::cluster {

DecodeHelper::DecodeHelper(const ClusterContext& context, const ClusterStore* store,
                           Transfer* transfer, uint64_t request_bytes)
    : context_(context), store_(store), transfer_(transfer), request_bytes_(request_bytes) {}

absl::StatusOr<v1::DecodeUnitsResponse> DecodeHelper::DecodeFor(
    const v1::DecodeUnitsRequest& request, const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mutex_);
  const erasure::StripeLayout& layout = context_.layout();
  const Topology& topology = *context_.topology;
  const uint32_t self = context_.node_id();
  const int k = layout.data_units();
  const int n = layout.group_size();
  const std::shared_ptr<const v1::JournalCluster> held = store_->ClusterRecord();
  const v1::JournalCluster& record = *held;
  if (!record.has_committed_step() || record.committed_step() != request.step()) {
    return absl::FailedPreconditionError(
        absl::StrCat("node ", self, " does not hold step ", request.step()));
  }
  if (record.group_images_size() != n) {
    return absl::FailedPreconditionError(
        absl::StrCat("node ", self, " holds ", record.group_images_size(), " images of step ",
                     request.step(), ", not its group's ", n));
  }
  const std::vector<uint64_t> sizes = ImageSizes(record);
  const uint64_t stripe_count = layout.StripeCount(sizes);
  // Every stripe once, of the step, holding bytes, with a target that holds bytes and k distinct
  // other sources; the scratch it takes (HelperStripeBytes) within HelperRequestBound().
  const uint64_t max_scratch = HelperRequestBound(layout, request_bytes_);
  std::set<uint64_t> seen;
  uint64_t scratch_bytes = 0;
  for (const v1::DecodeStripe& stripe : request.stripes()) {
    const std::string what = absl::StrCat("stripe ", stripe.stripe(), " of step ", request.step());
    if (stripe.stripe() >= stripe_count || !seen.insert(stripe.stripe()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, stripe.stripe() >= stripe_count
                                 ? absl::StrCat(": the step has ", stripe_count, " stripes")
                                 : " is asked for twice"));
    }
    std::set<uint32_t> sources(stripe.sources().begin(), stripe.sources().end());
    if (stripe.target() >= static_cast<uint32_t>(n) || stripe.sources_size() != k ||
        sources.size() != static_cast<size_t>(k) || *sources.rbegin() >= static_cast<uint32_t>(n) ||
        sources.contains(stripe.target())) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": decoding unit ", stripe.target(), " takes ", k,
                       " distinct other units of the stripe's ", n, ", got [",
                       absl::StrJoin(stripe.sources(), ", "), "]"));
    }
    const uint64_t length = layout.ParityLength(stripe.stripe(), sizes);
    if (UnitBytes(layout, sizes, stripe.stripe(), static_cast<int>(stripe.target()), length) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": unit ", stripe.target(), " holds no bytes to decode"));
    }
    scratch_bytes += HelperStripeBytes(layout, length);
    if (scratch_bytes > max_scratch) {
      return absl::InvalidArgumentError(absl::StrCat(request.stripes_size(),
                                                     " stripes take more than ", max_scratch,
                                                     " bytes to decode at once"));
    }
  }
  // Not zeroed: FetchSources fills every source (padding included) and the decode the target. The
  // stripe's other units are neither written nor read, and have no memory.
  if (scratch_bytes_ < scratch_bytes) {
    scratch_bytes_ = 0;
    scratch_.reset();
    scratch_ = std::make_unique_for_overwrite<uint8_t[]>(scratch_bytes);
    scratch_bytes_ = scratch_bytes;
  }
  uint8_t* const scratch = scratch_.get();
  std::vector<StripeUnits> works;
  uint64_t used = 0;
  for (const v1::DecodeStripe& stripe : request.stripes()) {
    StripeUnits work;
    work.stripe = stripe.stripe();
    work.length = layout.ParityLength(work.stripe, sizes);
    work.target = static_cast<int>(stripe.target());
    work.units.assign(n, nullptr);
    for (uint32_t i : stripe.sources()) work.chosen.push_back(static_cast<int>(i));
    for (int i : work.chosen) {
      work.units[i] = scratch + used;
      used += work.length;
    }
    work.units[work.target] = scratch + used;
    used += work.length;
    works.push_back(std::move(work));
  }
  // A caller that gave up (its deadline passed, another helper failed) is not served further.
  if (cancelled()) return absl::CancelledError("the rebuilding node no longer waits");
  Transfer::HeldUnits own;  // read by the decode below
  absl::StatusOr<uint64_t> fetched =
      FetchSources(request.step(), topology.group, sizes, works, &own);
  if (!fetched.ok()) return fetched.status();
  if (cancelled()) return absl::CancelledError("the rebuilding node no longer waits");
  v1::DecodeUnitsResponse response;
  response.set_fetched_bytes(*fetched);
  for (StripeUnits& work : works) {
    // The target alone: the stripe's other missing units are nobody's.
    const int wanted[] = {work.target};
    if (absl::Status decoded =
            topology.codec->DecodeFrom(work.units, work.chosen, wanted, work.length);
        !decoded.ok()) {
      return decoded;
    }
    FrameHeader header;
    header.kind = FrameKind::kFetchedUnit;
    header.step = request.step();
    header.rank = self;
    header.stripe = work.stripe;
    header.stripe_unit = static_cast<uint32_t>(work.target);
    header.attempt = request.request();
    const uint64_t bytes = UnitBytes(layout, sizes, work.stripe, work.target, work.length);
    if (absl::Status status =
            transfer_->SendFrames(request.to_node(), header, work.units[work.target], bytes);
        !status.ok()) {
      return status;
    }
    response.set_sent_bytes(response.sent_bytes() + bytes);
  }
  return response;
}

absl::StatusOr<uint64_t> DecodeHelper::FetchSources(int64_t step, int group,
                                                 const std::vector<uint64_t>& sizes,
                                                 std::vector<StripeUnits>& works,
                                                 Transfer::HeldUnits* own) {
  const erasure::StripeLayout& layout = context_.layout();
  const Topology& topology = *context_.topology;
  const uint32_t self = context_.node_id();
  const int64_t token = transfer_->NewRequest();
  std::map<uint32_t, v1::SendUnitsRequest> requests;
  std::vector<std::pair<FetchKey, FetchSlot>> slots;
  // This node's own units: read where they lie when they lie in one piece and need no padding,
  // else copied into their scratch.
  std::vector<std::pair<uint64_t, uint32_t>> own_refs;
  std::vector<uint8_t**> own_units;
  uint64_t fetched = 0;
  for (StripeUnits& work : works) {
    for (int i : work.chosen) {
      const uint64_t bytes = UnitBytes(layout, sizes, work.stripe, i, work.length);
      if (bytes == 0) {
        std::memset(work.units[i], 0, work.length);
        continue;
      }
      const uint32_t source = topology.NodeAt(group, PositionOf(layout, work.stripe, i));
      if (source == self) {
        own_refs.emplace_back(work.stripe, static_cast<uint32_t>(i));
        own_units.push_back(&work.units[i]);
        continue;
      }
      // Inputs read as zero past the unit's own bytes (virtually padded); outputs need no fill.
      std::memset(work.units[i] + bytes, 0, work.length - bytes);
      slots.push_back({{step, work.stripe, static_cast<uint32_t>(i), source, "", token},
                       {work.units[i], bytes, source}});
      v1::SendUnitsRequest& request = requests[source];
      request.set_to_node(self);
      request.set_step(step);
      request.set_request(token);
      v1::UnitRef* ref = request.add_units();
      ref->set_stripe(work.stripe);
      ref->set_unit(static_cast<uint32_t>(i));
      fetched += bytes;
    }
  }
  absl::StatusOr<Transfer::HeldUnits> held = transfer_->HoldOwnUnits(step, own_refs);
  if (!held.ok()) return held.status();
  for (size_t i = 0; i < own_refs.size(); ++i) {
    const auto& [stripe, unit] = own_refs[i];
    const std::vector<absl::Span<const uint8_t>>& spans = held->spans[i];
    const uint64_t length = layout.ParityLength(stripe, sizes);
    const uint64_t bytes = UnitBytes(layout, sizes, stripe, static_cast<int>(unit), length);
    uint64_t held_bytes = 0;
    for (absl::Span<const uint8_t> span : spans) held_bytes += span.size();
    if (held_bytes != bytes) {
      return absl::InternalError(absl::StrCat("node ", self, ": unit ", unit, " of stripe ",
                                              stripe, " is ", held_bytes, " bytes, not ", bytes));
    }
    // Decoded from here, it is checked here.
    if (absl::Status checked = held->CheckParity(i); !checked.ok()) {
      return absl::Status(checked.code(), absl::StrCat("node ", self, ": ", checked.message()));
    }
    if (spans.size() == 1 && bytes == length) {
      // Only read by the decode.
      *own_units[i] = const_cast<uint8_t*>(spans[0].data());
      continue;
    }
    uint8_t* out = *own_units[i];
    for (absl::Span<const uint8_t> span : spans) {
      std::memcpy(out, span.data(), span.size());
      out += span.size();
    }
    std::memset(out, 0, length - bytes);
  }
  *own = *std::move(held);
  if (absl::Status status = FetchFrom(transfer_, slots, requests,
                                     [&](uint32_t id, const v1::SendUnitsRequest& request) {
                                       return context_.peers->SendUnits(id, request).status();
                                     });
      !status.ok()) {
    return status;
  }
  return fetched;
}

}  // namespace moesnap::daemon::cluster
