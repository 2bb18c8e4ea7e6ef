// The sparse snapshot schedule for Mixture-of-Experts models (the MoEtion algorithm). An operator is
// one expert of one layer, or the non-expert and gate part of a layer. A window of W steps captures
// each operator's full state (master weights + optimizer moments) once, in slot order; in every slot
// the operators not yet captured are stored as weights only, and small always-captured state (RNG,
// loss scale) every step. Recovery replays the window with not-yet-captured operators frozen.
//
// Window size: the per-step budget is iteration time x copy bandwidth. Starting with every operator
// in one slot, the number captured per slot shrinks until the costliest slot fits; W is the number
// of slots. Slot i captures operators order[i*p, (i+1)*p) for p operators per slot.
// Order: experts by ascending token count (ties by their index in the operator list), then the
// non-expert operators in list order: popular experts are captured last and stay frozen longest in
// a replay, which cuts recomputation.
//
// Everything here is pure and deterministic for the same inputs; objects are immutable and safe to
// share between threads.
#ifndef MOESNAP_CLIENT_SPARSE_SCHEDULE_H_
#define MOESNAP_CLIENT_SPARSE_SCHEDULE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moesnap {

struct Operator {
  std::string name;               // e.g. "layer3.expert17" or "layer3.dense"
  bool is_expert = true;
  uint64_t full_state_bytes = 0;  // master weights + optimizer moments (about 12 bytes/parameter)
  uint64_t weight_bytes = 0;      // low-precision weights (about 2 bytes/parameter)
  double token_count = 0;         // tokens routed to the expert over a recent window; experts only
};

struct ScheduleOptions {
  double iteration_seconds = 0;       // measured or given
  double copy_bytes_per_second = 0;   // host copy bandwidth available to snapshots
  uint64_t every_step_bytes = 0;      // RNG, loss scale, data position: captured at every slot
  double reorder_fraction = 0.25;     // reorder when more than this fraction of experts ...
  double reorder_rate_change = 0.10;  // ... changed their token rate by more than this
  double iteration_drift = 0.10;      // regenerate when iteration time drifts by more than this
};

struct Slot {
  std::vector<int> captured;  // operator indices whose full state this slot captures
  uint64_t bytes = 0;         // full state of those + weights of every later operator + every-step
};

class SparseSchedule {
 public:
  // INVALID_ARGUMENT for no operators, non-positive time or bandwidth, negative token counts;
  // RESOURCE_EXHAUSTED (with both figures) when even one operator per slot exceeds the budget.
  static absl::StatusOr<SparseSchedule> Build(const std::vector<Operator>& operators,
                                              const ScheduleOptions& options);
  // The same operators and order with a window the job agreed on (at least window()): every rank
  // uses the largest window any rank needs.
  absl::StatusOr<SparseSchedule> WithWindow(int window) const;
  static int AgreedWindow(const std::vector<int>& windows_of_ranks);

  int window() const { return static_cast<int>(slots_.size()); }
  uint64_t budget_bytes() const { return budget_bytes_; }
  const std::vector<int>& order() const { return order_; }
  const std::vector<Slot>& slots() const { return slots_; }
  // The slot a step falls in: steps count from 1 within consecutive windows.
  int SlotOfStep(int64_t step) const { return static_cast<int>((step - 1) % window()); }
  // True when the operator's full state is captured at or before `slot` of the window.
  bool CapturedBy(int operator_index, int slot) const;

  // Whether new token counts (same operator order as Build's input) call for a new order.
  bool NeedsReorder(const std::vector<double>& token_counts) const;
  // Whether a new iteration time calls for a new window.
  bool NeedsRegeneration(double iteration_seconds) const;

 private:
  SparseSchedule() = default;
  static std::vector<Slot> SlotsFor(const std::vector<Operator>& operators,
                                    const std::vector<int>& order, int per_slot, uint64_t every_step);

  std::vector<Operator> operators_;
  ScheduleOptions options_;
  uint64_t budget_bytes_ = 0;
  std::vector<int> order_;
  std::vector<int> capture_slot_;  // per operator index
  std::vector<Slot> slots_;
};

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SPARSE_SCHEDULE_H_
