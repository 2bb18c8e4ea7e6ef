// ParityStore: units opened unwritten, coefficient-weighted addition of arriving data, completion.
#include "daemon/parity_store.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "erasure/crc32c.h"
#include "erasure/xor_bytes.h"

namespace moesnap::daemon {
namespace {

// Calls `piece(begin, end, written)` for the pieces of [begin, end) in order, each one either
// inside a range of `written` or outside all of them.
template <typename Piece>
void ForEachPiece(const std::map<uint64_t, uint64_t>& written, uint64_t begin, uint64_t end,
                  Piece piece) {
  auto range = written.upper_bound(begin);
  if (range != written.begin() && std::prev(range)->second > begin) --range;
  for (uint64_t at = begin; at < end;) {
    if (range != written.end() && range->first <= at) {
      const uint64_t until = std::min(range->second, end);
      piece(at, until, true);
      at = until;
      ++range;
    } else {
      const uint64_t until = range == written.end() ? end : std::min(range->first, end);
      piece(at, until, false);
      at = until;
    }
  }
}

// Adds [begin, end) to `written`, merging the ranges it overlaps or touches.
void AddWritten(std::map<uint64_t, uint64_t>& written, uint64_t begin, uint64_t end) {
  if (begin == end) return;
  auto range = written.upper_bound(begin);
  if (range != written.begin() && std::prev(range)->second >= begin) {
    --range;
    begin = range->first;
  }
  while (range != written.end() && range->first <= end) {
    end = std::max(end, range->second);
    range = written.erase(range);
  }
  written.emplace(begin, end);
}

}  // namespace

ParityStore::ParityStore(Pool* pool, const erasure::ReedSolomon* codec,
                         const erasure::StripeLayout* layout, int position,
                         absl::Duration begin_wait)
    : pool_(pool), codec_(codec), layout_(layout), position_(position), begin_wait_(begin_wait) {}

absl::Status ParityStore::Recover(const v1::JournalCluster& record) {
  absl::MutexLock lock(&mutex_);
  for (const v1::JournalParity& saved : record.parity()) {
    absl::StatusOr<std::shared_ptr<PoolExtent>> extent = pool_->Claim(saved.pool_offset(), saved.bytes());
    if (!extent.ok()) {
      return absl::DataLossError(absl::StrCat("journal entry for parity of stripe ", saved.stripe(),
                                              ": ", extent.status().message()));
    }
    committed_[saved.stripe()] = {saved.stripe(), saved.bytes(), saved.crc(), *std::move(extent)};
  }
  if (record.has_committed_step()) committed_step_ = record.committed_step();
  return absl::OkStatus();
}

uint64_t ParityStore::UnitBytes(const std::vector<uint64_t>& image_bytes) const {
  uint64_t bytes = 0;
  const uint64_t stripes = layout_->StripeCount(image_bytes);
  for (uint64_t stripe = 0; stripe < stripes; ++stripe) {
    if (layout_->IsParityPosition(stripe, position_)) {
      bytes += layout_->ParityLength(stripe, image_bytes);
    }
  }
  return bytes;
}

bool ParityStore::Fits(const std::vector<uint64_t>& image_bytes) const {
  return static_cast<int>(image_bytes.size()) == layout_->group_size() &&
         UnitBytes(image_bytes) <= pool_->free_bytes();
}

absl::Status ParityStore::Begin(int64_t step, int64_t attempt,
                               const std::vector<uint64_t>& image_bytes,
                               const StepChanges* changes, bool accumulate) {
  if (static_cast<int>(image_bytes.size()) != layout_->group_size()) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step, ": ", image_bytes.size(),
                                                   " image sizes for a group of ",
                                                   layout_->group_size()));
  }
  if (changes != nullptr && static_cast<int>(changes->units.size()) != layout_->group_size()) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step, ": changes of ",
                                                   changes->units.size(),
                                                   " positions for a group of ",
                                                   layout_->group_size()));
  }
  if (accumulate && changes == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step, ": an accumulation takes deltas of changed units only"));
  }
  const uint64_t stripes = layout_->StripeCount(image_bytes);
  if (changes != nullptr && !changes->fresh_stripes.empty() &&
      changes->fresh_stripes.size() != stripes) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step, ": fresh stripes of ",
                                                   changes->fresh_stripes.size(),
                                                   " stripes for ", stripes));
  }
  Pending pending;
  pending.attempt = attempt;
  pending.accumulate = accumulate;
  pending.missing_from.assign(image_bytes.size(), 0);
  Openings openings;
  for (uint64_t stripe = 0; stripe < stripes; ++stripe) {
    if (!layout_->IsParityPosition(stripe, position_)) continue;
    const uint64_t bytes = layout_->ParityLength(stripe, image_bytes);
    if (bytes == 0) continue;
    const bool fresh = changes != nullptr && changes->Fresh(stripe);
    if (fresh && accumulate) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", step, ": stripe ", stripe, " is encoded afresh, and its parity is accumulated"));
    }
    const erasure::StripeMembers members = layout_->Members(stripe);
    StripeArrivals arrivals(members.data_positions.size());
    uint64_t expected = 0;
    for (size_t index = 0; index < members.data_positions.size(); ++index) {
      const int position = members.data_positions[index];
      const uint64_t unit = layout_->DataUnitOf(position, stripe);
      if (changes != nullptr && !changes->Changed(position, unit)) continue;
      arrivals[index].length = layout_->UnitLength(image_bytes[position], unit);
      expected += arrivals[index].length;
    }
    const bool updated = changes != nullptr && !accumulate && !fresh;
    std::optional<ParityUnit> committed;
    if (updated) {
      absl::MutexLock lock(&mutex_);
      auto it = committed_.find(stripe);
      if (it == committed_.end() || it->second.bytes != bytes) {
        return absl::FailedPreconditionError(absl::StrCat(
            "step ", step, ": no committed parity of stripe ", stripe, " to update with deltas"));
      }
      committed = it->second;
    }
    if (updated && expected == 0) {
      // No data unit of the stripe changed: the committed unit is the step's too, shared (nothing
      // is expected for it, so any frame for it is refused; a repair rewrites the same bytes).
      pending.units[stripe] = *std::move(committed);
      pending.arrivals[stripe] = std::move(arrivals);
      pending.shared.insert(stripe);
      ++openings.shared;
      continue;
    }
    absl::StatusOr<std::shared_ptr<PoolExtent>> extent = pool_->Allocate(bytes);
    if (!extent.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat("parity of step ", step, ", stripe ", stripe,
                                                       ": ", extent.status().message()));
    }
    pending.writes[stripe] = std::make_shared<UnitWrites>(
        UnitWrites{.start = updated ? committed->extent : nullptr, .written = {}});
    ++(updated ? openings.updated
               : fresh ? openings.fresh
                       : accumulate ? openings.accumulated : openings.whole);
    pending.units[stripe] = {stripe, bytes, 0, *std::move(extent)};
    for (size_t index = 0; index < members.data_positions.size(); ++index) {
      pending.missing_from[members.data_positions[index]] += arrivals[index].length;
    }
    pending.arrivals[stripe] = std::move(arrivals);
    pending.missing += expected;
  }
  pending.complete = pending.missing == 0;
  absl::MutexLock lock(&mutex_);
  if (auto it = pending_.find(step); it != pending_.end() && it->second.attempt > attempt) {
    return absl::FailedPreconditionError(absl::StrCat("step ", step, " is open for attempt ",
                                                      it->second.attempt, ", newer than ", attempt));
  }
  pending.opening = ++openings_made_;
  pending_[step] = std::move(pending);
  openings_ += openings;
  changed_.SignalAll();
  return absl::OkStatus();
}

ParityStore::Openings ParityStore::openings() const {
  absl::MutexLock lock(&mutex_);
  return openings_;
}

absl::Status ParityStore::Accept(const FrameHeader& header, absl::Span<const uint8_t> payload) {
  // Bounds from the wire that hold whatever the step, checked without overflow before any wait: a
  // frame no unit can hold is refused at once, not after a wait for its step to open.
  if (header.length == 0 || payload.size() != header.length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", header.step, ", stripe ", header.stripe, ": a data frame of ", payload.size(),
        " bytes (its header says ", header.length, "); every data frame carries bytes"));
  }
  if (header.stripe_unit >= static_cast<uint32_t>(layout_->data_units()) ||
      header.offset > layout_->unit_bytes() ||
      header.length > layout_->unit_bytes() - header.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", header.step, ", stripe ", header.stripe, ": data unit ", header.stripe_unit,
        " (of ", layout_->data_units(), ") bytes [", header.offset, ", +", header.length,
        ") do not fit a unit of ", layout_->unit_bytes(), " bytes"));
  }
  std::shared_ptr<PoolExtent> extent;
  std::shared_ptr<UnitWrites> writes;
  uint64_t opening = 0;  // of the step's Pending the frame was taken by
  {
    absl::MutexLock lock(&mutex_);
    const absl::Time deadline = absl::Now() + begin_wait_;
    auto open = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
      auto it = pending_.find(header.step);
      return it != pending_.end() && it->second.attempt >= header.attempt;
    };
    while (!open()) {
      if (discarded_.contains(header.step)) return absl::OkStatus();  // aborted: dropped
      if (committed_step_ && header.step <= *committed_step_) {
        return absl::FailedPreconditionError(
            absl::StrCat("parity data for step ", header.step, ", which is already committed"));
      }
      if (changed_.WaitWithDeadline(&mutex_, deadline)) {
        return absl::FailedPreconditionError(
            absl::StrCat("parity data for step ", header.step, ", which this node has not opened"));
      }
    }
    Pending& pending = pending_[header.step];
    if (pending.attempt != header.attempt) return absl::OkStatus();  // an older attempt's: dropped
    auto unit = pending.units.find(header.stripe);
    if (unit == pending.units.end()) {
      return absl::InvalidArgumentError(absl::StrCat("step ", header.step, ": this node holds no "
                                                     "parity of stripe ", header.stripe));
    }
    // This stripe's unit may be shorter than a whole one (checked above); without overflow, since
    // offset + length fit a whole unit.
    if (header.offset > unit->second.bytes || header.length > unit->second.bytes - header.offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", header.step, ", stripe ", header.stripe, ": data unit ", header.stripe_unit,
          " bytes [", header.offset, ", ", header.offset + header.length, ") do not fit a unit of ",
          unit->second.bytes, " bytes"));
    }
    UnitArrivals& arrivals = pending.arrivals[header.stripe][header.stripe_unit];
    if (absl::Status fits = CheckArrival(header, arrivals); !fits.ok()) return fits;
    const auto unit_writes = pending.writes.find(header.stripe);
    if (unit_writes == pending.writes.end()) {  // shared: nothing is expected (refused above)
      return absl::InvalidArgumentError(absl::StrCat("step ", header.step, ", stripe ",
                                                     header.stripe, ": its parity is the committed "
                                                     "unit, and no data is expected for it"));
    }
    // Taken now; a failed addition below aborts the whole step anyway.
    AddWritten(arrivals.arrived, header.offset, header.offset + header.length);
    opening = pending.opening;
    extent = unit->second.extent;
    writes = unit_writes->second;
  }
  const erasure::StripeMembers members = layout_->Members(header.stripe);
  const int parity_index = [&] {
    const std::vector<int>& holders = members.parity_positions;
    for (size_t j = 0; j < holders.size(); ++j) {
      if (holders[j] == position_) return static_cast<int>(j);
    }
    return -1;
  }();
  {
    absl::MutexLock lock(&StripeLock(header.stripe));
    if (absl::Status status = AddFrame(*writes, static_cast<int>(header.stripe_unit), parity_index,
                                       header.offset, payload, extent->data());
        !status.ok()) {
      return status;
    }
  }
  absl::MutexLock lock(&mutex_);
  auto it = pending_.find(header.step);
  // Aborted, or opened again, meanwhile.
  if (it == pending_.end() || it->second.opening != opening) return absl::OkStatus();
  it->second.missing -= header.length;
  it->second.missing_from[members.data_positions[header.stripe_unit]] -= header.length;
  if (it->second.missing == 0) {
    it->second.complete = true;
    changed_.SignalAll();
  }
  return absl::OkStatus();
}

absl::Status ParityStore::AddFrame(UnitWrites& writes, int data_index, int parity_index,
                                  uint64_t offset, absl::Span<const uint8_t> payload,
                                  uint8_t* parity) const {
  absl::Status status;
  ForEachPiece(writes.written, offset, offset + payload.size(),
               [&](uint64_t begin, uint64_t end, bool written) {
                 if (!status.ok()) return;
                 const uint8_t* delta = payload.data() + (begin - offset);
                 status = written ? codec_->UpdateParityUnit(data_index, parity_index, delta,
                                                             parity + begin, end - begin)
                                  : codec_->UpdatedParityUnit(
                                        data_index, parity_index,
                                        writes.start ? writes.start->data() + begin : nullptr,
                                        delta, parity + begin, end - begin);
               });
  if (status.ok()) AddWritten(writes.written, offset, offset + payload.size());
  return status;
}

absl::Status ParityStore::CheckArrival(const FrameHeader& header, const UnitArrivals& arrivals) {
  auto unit = [&] {  // for the message, made only for a refusal
    return absl::StrCat("step ", header.step, ", stripe ", header.stripe, ": data unit ",
                        header.stripe_unit);
  };
  if (arrivals.length == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        unit(), ": nothing of it is expected (it did not change, or no frame is taken for its "
        "stripe)"));
  }
  if (header.offset > arrivals.length || header.length > arrivals.length - header.offset) {
    return absl::InvalidArgumentError(absl::StrCat(unit(), ": bytes [", header.offset, ", +",
                                                   header.length, ") do not fit its ",
                                                   arrivals.length, " bytes"));
  }
  const uint64_t end = header.offset + header.length;
  auto after = arrivals.arrived.upper_bound(header.offset);  // the first range beginning later
  const bool overlaps_before =
      after != arrivals.arrived.begin() && std::prev(after)->second > header.offset;
  const bool overlaps_after = after != arrivals.arrived.end() && after->first < end;
  if (overlaps_before || overlaps_after) {
    return absl::InvalidArgumentError(absl::StrCat(unit(), ": bytes [", header.offset, ", ", end,
                                                   ") arrived already, in part or whole"));
  }
  return absl::OkStatus();
}

void ParityStore::FillUnwritten(UnitWrites& writes, const ParityUnit& unit) {
  uint8_t* parity = unit.extent->data();
  ForEachPiece(writes.written, 0, unit.bytes, [&](uint64_t begin, uint64_t end, bool written) {
    if (written) return;
    if (writes.start) {
      std::memcpy(parity + begin, writes.start->data() + begin, end - begin);
    } else {
      std::memset(parity + begin, 0, end - begin);
    }
  });
  AddWritten(writes.written, 0, unit.bytes);
}

void ParityStore::FailIncomplete(absl::Span<const int> positions, const std::string& why) {
  absl::MutexLock lock(&mutex_);
  for (auto& step : pending_) {
    Pending& pending = step.second;
    if (pending.complete || !pending.failure.empty()) continue;
    const bool waits_for_them = std::any_of(positions.begin(), positions.end(), [&](int position) {
      return position >= 0 && static_cast<size_t>(position) < pending.missing_from.size() &&
             pending.missing_from[position] > 0;
    });
    if (waits_for_them) pending.failure = why;
  }
  changed_.SignalAll();
}

absl::Status ParityStore::WaitComplete(int64_t step, absl::Time deadline) {
  // (stripe, unit) of the step's own units: their extents held, so that a decision applied
  // meanwhile (Discard, Commit of a later step, Begin of a newer attempt) cannot free them here.
  std::vector<std::pair<uint64_t, ParityUnit>> units;
  std::vector<std::shared_ptr<UnitWrites>> writes;  // of each of `units`
  int64_t attempt = 0;
  {
    absl::MutexLock lock(&mutex_);
    while (true) {
      auto it = pending_.find(step);
      if (it == pending_.end()) {
        return absl::AbortedError(absl::StrCat("parity of step ", step, " was aborted"));
      }
      if (it->second.complete) break;
      if (!it->second.failure.empty()) {
        return absl::UnavailableError(
            absl::StrCat("parity of step ", step, ": ", it->second.failure));
      }
      if (changed_.WaitWithDeadline(&mutex_, deadline)) {
        return absl::DeadlineExceededError(absl::StrCat(
            "parity of step ", step, ": ", it->second.missing,
            " bytes of data units have not arrived from the group's data nodes"));
      }
    }
    const Pending& pending = pending_[step];
    attempt = pending.attempt;
    for (const auto& [stripe, unit] : pending.units) {
      if (!pending.shared.contains(stripe)) {
        units.emplace_back(stripe, unit);
        writes.push_back(pending.writes.at(stripe));
      }
    }
  }
  // No frame writes a complete unit any more: fill and checksum them outside the lock.
  for (size_t i = 0; i < units.size(); ++i) {
    ParityUnit& unit = units[i].second;
    {
      absl::MutexLock lock(&StripeLock(unit.stripe));
      FillUnwritten(*writes[i], unit);
    }
    unit.crc = erasure::Crc32c(unit.extent->data(), unit.bytes);
  }
  absl::MutexLock lock(&mutex_);
  auto it = pending_.find(step);
  if (it == pending_.end() || it->second.attempt != attempt) {
    return absl::AbortedError(absl::StrCat("parity of step ", step, " was aborted"));
  }
  for (const auto& [stripe, unit] : units) it->second.units[stripe].crc = unit.crc;
  return absl::OkStatus();
}

v1::JournalParity ParityStore::RecordOf(const ParityUnit& unit) {
  v1::JournalParity record;
  record.set_stripe(unit.stripe);
  record.set_pool_offset(unit.extent->offset());
  record.set_bytes(unit.bytes);
  record.set_crc(unit.crc);
  return record;
}

std::vector<v1::JournalParity> ParityStore::Records(int64_t step) const {
  std::vector<v1::JournalParity> records;
  absl::MutexLock lock(&mutex_);
  auto it = pending_.find(step);
  const std::map<uint64_t, ParityUnit>& units =
      it != pending_.end() ? it->second.units : committed_;
  for (const auto& [stripe, unit] : units) records.push_back(RecordOf(unit));
  return records;
}

void ParityStore::Commit(int64_t step) {
  absl::MutexLock lock(&mutex_);
  auto it = pending_.find(step);
  if (it != pending_.end() && !it->second.accumulate) {
    committed_ = std::move(it->second.units);  // frees the previous step's units
  } else if (auto kept = accumulated_.find(step);
             kept != accumulated_.end() && kept->second.folded) {
    committed_ = std::move(kept->second.units);
  } else {
    return;
  }
  committed_step_ = step;
  // Older open steps can never commit now.
  pending_.erase(pending_.begin(), pending_.upper_bound(step));
  accumulated_.erase(accumulated_.begin(), accumulated_.upper_bound(step));
  discarded_.erase(discarded_.begin(), discarded_.upper_bound(step));
  changed_.SignalAll();
}

bool ParityStore::KeepAccumulated(int64_t step, int64_t attempt, int64_t base,
                                  std::vector<v1::NodeImage> group_images) {
  absl::MutexLock lock(&mutex_);
  auto it = pending_.find(step);
  if (it == pending_.end() || !it->second.accumulate || !it->second.complete ||
      it->second.attempt != attempt) {
    return false;
  }
  accumulated_[step] = {base, std::move(group_images), std::move(it->second.units), false};
  pending_.erase(it);
  changed_.SignalAll();
  return true;
}

std::optional<std::pair<int64_t, std::vector<v1::NodeImage>>> ParityStore::NextAccumulated()
    const {
  absl::MutexLock lock(&mutex_);
  if (!committed_step_) return std::nullopt;
  for (const auto& [step, kept] : accumulated_) {
    if (kept.base == *committed_step_ && !kept.folded) {
      return std::make_pair(step, kept.group_images);
    }
  }
  return std::nullopt;
}

absl::StatusOr<std::vector<v1::JournalParity>> ParityStore::FoldAccumulated(int64_t step) {
  std::vector<std::pair<ParityUnit*, std::shared_ptr<PoolExtent>>> pairs;
  {
    absl::MutexLock lock(&mutex_);
    auto it = accumulated_.find(step);
    if (it == accumulated_.end() || it->second.folded || !committed_step_ ||
        it->second.base != *committed_step_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no parity accumulated for step ", step, " against the committed step ",
          committed_step_ ? absl::StrCat(*committed_step_) : "(none)"));
    }
    if (it->second.units.size() != committed_.size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step, " accumulated ", it->second.units.size(), " parity units, the committed ",
          "step holds ", committed_.size()));
    }
    for (auto& [stripe, unit] : it->second.units) {
      auto committed = committed_.find(stripe);
      if (committed == committed_.end() || committed->second.bytes != unit.bytes) {
        return absl::FailedPreconditionError(absl::StrCat(
            "step ", step, ": the committed parity of stripe ", stripe, " does not match the ",
            "accumulated one"));
      }
      pairs.push_back({&unit, committed->second.extent});
    }
  }
  // Only this call writes a kept accumulation, and committed units are never written: XOR and
  // checksum outside the lock.
  std::vector<v1::JournalParity> records;
  for (auto& [unit, committed] : pairs) {
    uint8_t* out = unit->extent->data();
    const uint8_t* in = committed->data();
    erasure::XorInto(out, in, unit->bytes);
    unit->crc = erasure::Crc32c(out, unit->bytes);
    records.push_back(RecordOf(*unit));
  }
  absl::MutexLock lock(&mutex_);
  if (auto it = accumulated_.find(step); it != accumulated_.end()) it->second.folded = true;
  return records;
}

size_t ParityStore::accumulated_steps() const {
  absl::MutexLock lock(&mutex_);
  return accumulated_.size();
}

void ParityStore::Abort(int64_t step) {
  absl::MutexLock lock(&mutex_);
  pending_.erase(step);
  changed_.SignalAll();
}

void ParityStore::Discard(int64_t step) {
  absl::MutexLock lock(&mutex_);
  pending_.erase(step);
  if (!committed_step_ || step > *committed_step_) discarded_.insert(step);
  changed_.SignalAll();
}

void ParityStore::Install(int64_t step, std::vector<ParityUnit> units) {
  absl::MutexLock lock(&mutex_);
  committed_.clear();
  for (ParityUnit& unit : units) committed_[unit.stripe] = std::move(unit);
  committed_step_ = step;
  pending_.erase(pending_.begin(), pending_.upper_bound(step));
  accumulated_.erase(accumulated_.begin(), accumulated_.upper_bound(step));
  discarded_.erase(discarded_.begin(), discarded_.upper_bound(step));
}

std::optional<ParityUnit> ParityStore::Committed(uint64_t stripe) const {
  absl::MutexLock lock(&mutex_);
  auto it = committed_.find(stripe);
  if (it == committed_.end()) return std::nullopt;
  return it->second;
}

std::optional<ParityUnit> ParityStore::CommittedOf(int64_t step, uint64_t stripe) const {
  absl::MutexLock lock(&mutex_);
  if (committed_step_ != step) return std::nullopt;
  auto it = committed_.find(stripe);
  if (it == committed_.end()) return std::nullopt;
  return it->second;
}

std::vector<ParityUnit> ParityStore::CommittedUnits() const {
  absl::MutexLock lock(&mutex_);
  std::vector<ParityUnit> units;
  for (const auto& [stripe, unit] : committed_) units.push_back(unit);
  return units;
}

uint64_t ParityStore::committed_bytes() const {
  absl::MutexLock lock(&mutex_);
  uint64_t bytes = 0;
  for (const auto& [stripe, unit] : committed_) bytes += unit.bytes;
  return bytes;
}

uint64_t ParityStore::in_flight_bytes() const {
  absl::MutexLock lock(&mutex_);
  uint64_t bytes = 0;
  for (const auto& [step, pending] : pending_) {
    for (const auto& [stripe, unit] : pending.units) {
      if (!pending.shared.contains(stripe)) bytes += unit.bytes;
    }
  }
  for (const auto& [step, kept] : accumulated_) {
    for (const auto& [stripe, unit] : kept.units) bytes += unit.bytes;
  }
  return bytes;
}

}  // namespace moesnap::daemon
