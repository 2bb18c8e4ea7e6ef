// SparseSchedule: ordering, slot partition and window search.
#include "moesnap/sparse_schedule.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace moesnap {

std::vector<Slot> SparseSchedule::SlotsFor(const std::vector<Operator>& operators,
                                           const std::vector<int>& order, int per_slot,
                                           uint64_t every_step) {
  const int count = static_cast<int>(order.size());
  const int window = (count + per_slot - 1) / per_slot;
  std::vector<Slot> slots(window);
  // Weights of the operators captured after slot i: a suffix sum over the order.
  std::vector<uint64_t> later_weights(window + 1, 0);
  for (int slot = window - 1; slot >= 0; --slot) {
    later_weights[slot] = later_weights[slot + 1];
    for (int i = slot * per_slot; i < std::min(count, (slot + 1) * per_slot); ++i) {
      later_weights[slot] += operators[order[i]].weight_bytes;
    }
  }
  for (int slot = 0; slot < window; ++slot) {
    uint64_t full = 0;
    for (int i = slot * per_slot; i < std::min(count, (slot + 1) * per_slot); ++i) {
      slots[slot].captured.push_back(order[i]);
      full += operators[order[i]].full_state_bytes;
    }
    slots[slot].bytes = full + later_weights[slot + 1] + every_step;
  }
  return slots;
}

absl::StatusOr<SparseSchedule> SparseSchedule::Build(const std::vector<Operator>& operators,
                                                     const ScheduleOptions& options) {
  if (operators.empty()) return absl::InvalidArgumentError("a schedule needs at least one operator");
  if (!(options.iteration_seconds > 0) || !(options.copy_bytes_per_second > 0) ||
      !std::isfinite(options.iteration_seconds) || !std::isfinite(options.copy_bytes_per_second)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "iteration time and copy bandwidth must be positive, got ", options.iteration_seconds,
        " s and ", options.copy_bytes_per_second, " B/s"));
  }
  for (const Operator& op : operators) {
    if (!(op.token_count >= 0) || !std::isfinite(op.token_count)) {
      return absl::InvalidArgumentError(
          absl::StrCat("operator '", op.name, "' has token count ", op.token_count));
    }
  }
  SparseSchedule schedule;
  schedule.operators_ = operators;
  schedule.options_ = options;
  schedule.budget_bytes_ =
      static_cast<uint64_t>(options.iteration_seconds * options.copy_bytes_per_second);

  std::vector<int> experts, others;
  for (int i = 0; i < static_cast<int>(operators.size()); ++i) {
    (operators[i].is_expert ? experts : others).push_back(i);
  }
  std::stable_sort(experts.begin(), experts.end(), [&](int a, int b) {
    return operators[a].token_count < operators[b].token_count;
  });
  schedule.order_ = experts;
  schedule.order_.insert(schedule.order_.end(), others.begin(), others.end());

  const int count = static_cast<int>(operators.size());
  uint64_t smallest_costliest = UINT64_MAX;
  for (int per_slot = count; per_slot >= 1; --per_slot) {
    std::vector<Slot> slots = SlotsFor(operators, schedule.order_, per_slot, options.every_step_bytes);
    uint64_t costliest = 0;
    for (const Slot& slot : slots) costliest = std::max(costliest, slot.bytes);
    smallest_costliest = std::min(smallest_costliest, costliest);
    if (costliest <= schedule.budget_bytes_) {
      schedule.slots_ = std::move(slots);
      break;
    }
  }
  if (schedule.slots_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no window fits: the cheapest schedule needs ", smallest_costliest,
        " bytes in its costliest step, but the budget is ", schedule.budget_bytes_, " (",
        options.iteration_seconds, " s x ", options.copy_bytes_per_second, " B/s)"));
  }
  schedule.capture_slot_.assign(count, 0);
  for (int slot = 0; slot < schedule.window(); ++slot) {
    for (int op : schedule.slots_[slot].captured) schedule.capture_slot_[op] = slot;
  }
  return schedule;
}

absl::StatusOr<SparseSchedule> SparseSchedule::WithWindow(int window) const {
  const int count = static_cast<int>(operators_.size());
  if (window < this->window() || window > count) {
    return absl::InvalidArgumentError(absl::StrCat("window ", window, " must be in [", this->window(),
                                                   ", ", count, "] for this schedule"));
  }
  SparseSchedule schedule = *this;
  const int per_slot = (count + window - 1) / window;
  schedule.slots_ = SlotsFor(operators_, order_, per_slot, options_.every_step_bytes);
  // Fewer operators per slot leave more weights-only bytes in early slots: check the budget again.
  for (size_t slot = 0; slot < schedule.slots_.size(); ++slot) {
    if (schedule.slots_[slot].bytes > budget_bytes_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "with window ", window, ", slot ", slot, " needs ", schedule.slots_[slot].bytes,
          " bytes, over this rank's budget of ", budget_bytes_));
    }
  }
  // Slots past the last operator capture nothing but the every-step state.
  while (static_cast<int>(schedule.slots_.size()) < window) {
    schedule.slots_.push_back({{}, options_.every_step_bytes});
  }
  for (int slot = 0; slot < schedule.window(); ++slot) {
    for (int op : schedule.slots_[slot].captured) schedule.capture_slot_[op] = slot;
  }
  return schedule;
}

int SparseSchedule::AgreedWindow(const std::vector<int>& windows_of_ranks) {
  return windows_of_ranks.empty() ? 0 : *std::max_element(windows_of_ranks.begin(), windows_of_ranks.end());
}

bool SparseSchedule::CapturedBy(int operator_index, int slot) const {
  return capture_slot_[operator_index] <= slot;
}

bool SparseSchedule::NeedsReorder(const std::vector<double>& token_counts) const {
  int experts = 0, changed = 0;
  for (size_t i = 0; i < operators_.size() && i < token_counts.size(); ++i) {
    if (!operators_[i].is_expert) continue;
    ++experts;
    const double before = operators_[i].token_count;
    const double change = before > 0 ? std::abs(token_counts[i] - before) / before
                                     : (token_counts[i] > 0 ? INFINITY : 0);
    if (change > options_.reorder_rate_change) ++changed;
  }
  return experts > 0 && changed > options_.reorder_fraction * experts;
}

bool SparseSchedule::NeedsRegeneration(double iteration_seconds) const {
  return std::abs(iteration_seconds - options_.iteration_seconds) >
         options_.iteration_drift * options_.iteration_seconds;
}

}  // namespace moesnap
