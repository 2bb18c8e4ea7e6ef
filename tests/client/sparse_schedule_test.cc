// SparseSchedule: a worked example by hand, the window search's guarantees on random instances,
// a DeepSeek-MoE-16B-shaped operator table, ordering, reordering and regeneration triggers.
#include "moesnap/sparse_schedule.h"

#include <gtest/gtest.h>

#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/testing/deterministic_bytes.h"
#include "tests/testing/status_matchers.h"

namespace moesnap {
namespace {

// Four experts (full state 12, weights 2) with token counts 40, 10, 30, 20, and one dense part (24, 4).
std::vector<Operator> SmallModel() {
  return {{"layer0.expert0", true, 12, 2, 40}, {"layer0.expert1", true, 12, 2, 10},
          {"layer0.expert2", true, 12, 2, 30}, {"layer0.expert3", true, 12, 2, 20},
          {"layer0.dense", false, 24, 4, 0}};
}

ScheduleOptions Budget(double bytes) {
  return {.iteration_seconds = 1, .copy_bytes_per_second = bytes, .every_step_bytes = 1};
}

TEST(SparseScheduleTest, WorkedExample) {
  // Budget 33: two operators per slot fits (slot bytes 24+8+1=33, 24+4+1=29, 24+0+1=25); three do
  // not (36+6+1=43). So W = 3, experts by ascending tokens, the dense part last.
  absl::StatusOr<SparseSchedule> schedule = SparseSchedule::Build(SmallModel(), Budget(33));
  ASSERT_OK(schedule);
  EXPECT_EQ(schedule->order(), (std::vector<int>{1, 3, 2, 0, 4}));
  ASSERT_EQ(schedule->window(), 3);
  EXPECT_EQ(schedule->slots()[0].captured, (std::vector<int>{1, 3}));
  EXPECT_EQ(schedule->slots()[0].bytes, 33u);
  EXPECT_EQ(schedule->slots()[1].bytes, 29u);
  EXPECT_EQ(schedule->slots()[2].captured, (std::vector<int>{4}));
  EXPECT_EQ(schedule->slots()[2].bytes, 25u);
  EXPECT_TRUE(schedule->CapturedBy(3, 0));
  EXPECT_FALSE(schedule->CapturedBy(0, 0));
  EXPECT_EQ(schedule->SlotOfStep(1), 0);
  EXPECT_EQ(schedule->SlotOfStep(4), 0);
  EXPECT_EQ(schedule->SlotOfStep(6), 2);

  // Budget 30: only one operator per slot fits, W = 5.
  absl::StatusOr<SparseSchedule> tight = SparseSchedule::Build(SmallModel(), Budget(30));
  ASSERT_OK(tight);
  EXPECT_EQ(tight->window(), 5);
  // A budget everything fits in: one slot captures everything.
  absl::StatusOr<SparseSchedule> loose = SparseSchedule::Build(SmallModel(), Budget(73));
  ASSERT_OK(loose);
  EXPECT_EQ(loose->window(), 1);
}

TEST(SparseScheduleTest, TooSmallABudgetSaysWhatIsNeeded) {
  absl::StatusOr<SparseSchedule> schedule = SparseSchedule::Build(SmallModel(), Budget(20));
  ASSERT_STATUS(schedule, absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(schedule.status().message(), "needs 25 bytes")) << schedule.status();
  EXPECT_TRUE(absl::StrContains(schedule.status().message(), "budget is 20")) << schedule.status();
  EXPECT_STATUS(SparseSchedule::Build({}, Budget(20)), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(SparseSchedule::Build(SmallModel(), Budget(0)), absl::StatusCode::kInvalidArgument);
  std::vector<Operator> negative = SmallModel();
  negative[2].token_count = -1;
  EXPECT_STATUS(SparseSchedule::Build(negative, Budget(100)), absl::StatusCode::kInvalidArgument);
}

TEST(SparseScheduleTest, RandomInstancesFitTheBudgetWithTheSmallestEqualSlotWindow) {
  testing::DeterministicBytes random(5);
  for (int instance = 0; instance < 300; ++instance) {
    std::vector<Operator> operators;
    const int count = 1 + static_cast<int>(random.Next() % 40);
    for (int i = 0; i < count; ++i) {
      const uint64_t weights = 1 + random.Next() % 100;
      operators.push_back({absl::StrCat("op", i), random.Next() % 5 != 0, 6 * weights, weights,
                           static_cast<double>(random.Next() % 1000)});
    }
    const double budget = 10 + static_cast<double>(random.Next() % 3000);
    absl::StatusOr<SparseSchedule> schedule = SparseSchedule::Build(operators, Budget(budget));
    if (!schedule.ok()) {
      ASSERT_STATUS(schedule, absl::StatusCode::kResourceExhausted);
      continue;
    }
    std::multiset<int> captured;
    for (const Slot& slot : schedule->slots()) {
      ASSERT_LE(slot.bytes, schedule->budget_bytes());
      captured.insert(slot.captured.begin(), slot.captured.end());
    }
    ASSERT_EQ(captured.size(), static_cast<size_t>(count));
    ASSERT_EQ(std::set<int>(captured.begin(), captured.end()).size(), static_cast<size_t>(count));
    // One more operator per slot would not fit (or there is only one slot already).
    const int per_slot = static_cast<int>(schedule->slots()[0].captured.size());
    if (per_slot < count) {
      uint64_t costliest = 0;
      const std::vector<int>& order = schedule->order();
      const int more = per_slot + 1;
      for (int start = 0; start < count; start += more) {
        uint64_t bytes = 1;
        for (int i = start; i < std::min(count, start + more); ++i) bytes += operators[order[i]].full_state_bytes;
        for (int i = start + more; i < count; ++i) bytes += operators[order[i]].weight_bytes;
        costliest = std::max(costliest, bytes);
      }
      ASSERT_GT(costliest, schedule->budget_bytes()) << "instance " << instance;
    }
    // Experts come in ascending token order, then the rest.
    bool seen_other = false;
    double last_tokens = -1;
    for (int op : schedule->order()) {
      if (!operators[op].is_expert) {
        seen_other = true;
        continue;
      }
      ASSERT_FALSE(seen_other) << "an expert after a non-expert operator";
      ASSERT_GE(operators[op].token_count, last_tokens);
      last_tokens = operators[op].token_count;
    }
  }
}

TEST(SparseScheduleTest, DeepSeekMoe16BShapedTable) {
  // 28 layers x 64 routed experts of 3 x 2048 x 1408 parameters; per layer a dense part of
  // attention (4 x 2048^2), the gate (2048 x 64) and two shared experts. fp32 master + Adam:
  // 12 bytes/parameter; bf16 weights: 2 bytes/parameter.
  std::vector<Operator> operators;
  const uint64_t expert_parameters = 3ULL * 2048 * 1408;
  const uint64_t dense_parameters = 4ULL * 2048 * 2048 + 2048ULL * 64 + 2 * expert_parameters;
  testing::DeterministicBytes random(16);
  for (int layer = 0; layer < 28; ++layer) {
    for (int expert = 0; expert < 64; ++expert) {
      operators.push_back({absl::StrCat("layer", layer, ".expert", expert), true,
                           12 * expert_parameters, 2 * expert_parameters,
                           static_cast<double>(random.Next() % 100000)});
    }
    operators.push_back({absl::StrCat("layer", layer, ".dense"), false, 12 * dense_parameters,
                         2 * dense_parameters, 0});
  }
  // One rank's share of a 16B model over 8 ranks is about 1/8 of these bytes; the whole table at
  // 2 s per iteration and 25 GB/s.
  absl::StatusOr<SparseSchedule> schedule = SparseSchedule::Build(
      operators, {.iteration_seconds = 2, .copy_bytes_per_second = 25e9, .every_step_bytes = 1 << 20});
  ASSERT_OK(schedule);
  EXPECT_GT(schedule->window(), 1);
  EXPECT_LT(schedule->window(), static_cast<int>(operators.size()));
  for (const Slot& slot : schedule->slots()) EXPECT_LE(slot.bytes, 50'000'000'000ULL);
  std::printf("DeepSeek-MoE-16B-shaped: %zu operators, window %d, first slot %.1f GB\n",
              operators.size(), schedule->window(), schedule->slots()[0].bytes / 1e9);
}

TEST(SparseScheduleTest, JobAgreesOnTheLargestWindow) {
  absl::StatusOr<SparseSchedule> schedule = SparseSchedule::Build(SmallModel(), Budget(33));
  ASSERT_OK(schedule);
  EXPECT_EQ(SparseSchedule::AgreedWindow({3, 5, 2}), 5);
  absl::StatusOr<SparseSchedule> wider = schedule->WithWindow(5);
  ASSERT_OK(wider);
  EXPECT_EQ(wider->window(), 5);
  EXPECT_EQ(wider->order(), schedule->order());
  EXPECT_STATUS(schedule->WithWindow(2), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(schedule->WithWindow(6), absl::StatusCode::kInvalidArgument);
  // Window 4 needs 2 operators in the first slot then one each: slot 0 is 24+8+1 = 33, still fits.
  absl::StatusOr<SparseSchedule> four = schedule->WithWindow(4);
  ASSERT_OK(four);
  EXPECT_EQ(four->window(), 4);
}

TEST(SparseScheduleTest, ReorderAndRegenerationTriggers) {
  absl::StatusOr<SparseSchedule> schedule = SparseSchedule::Build(SmallModel(), Budget(33));
  ASSERT_OK(schedule);
  // One expert of four changes by 50%: 25% changed, not more than the threshold.
  EXPECT_FALSE(schedule->NeedsReorder({60, 10, 30, 20, 0}));
  // Two of four change: 50% > 25%.
  EXPECT_TRUE(schedule->NeedsReorder({60, 20, 30, 20, 0}));
  // Changes within 10% do not count.
  EXPECT_FALSE(schedule->NeedsReorder({43, 10.5, 28, 21, 0}));
  EXPECT_FALSE(schedule->NeedsRegeneration(1.05));
  EXPECT_TRUE(schedule->NeedsRegeneration(1.2));
  EXPECT_TRUE(schedule->NeedsRegeneration(0.8));
}

}  // namespace
}  // namespace moesnap
