// Which committed steps are drained: by runs of steps, by wall-clock periods, or both; the same
// answer on every node that commits the same steps.
#include "daemon/durable/drain_schedule.h"

#include <gtest/gtest.h>

namespace moesnap::daemon::durable {
namespace {

const absl::Time kNoon = absl::FromUnixSeconds(1'700'000'080);  // 40 s into a minute

TEST(DrainScheduleTest, EveryStepsDrainsTheFirstCommittedStepOfEachRun) {
  const DrainSchedule schedule(2, 0);
  EXPECT_TRUE(schedule.Due(std::nullopt, 7, kNoon, kNoon));  // nothing before: the first is due
  EXPECT_TRUE(schedule.Due(1, 2, kNoon, kNoon));
  EXPECT_FALSE(schedule.Due(2, 3, kNoon, kNoon));
  EXPECT_TRUE(schedule.Due(3, 4, kNoon, kNoon));
  EXPECT_TRUE(schedule.Due(3, 5, kNoon, kNoon));   // step 4 aborted: 5 starts the run 4-5
  EXPECT_FALSE(schedule.Due(4, 5, kNoon, kNoon));
  EXPECT_TRUE(schedule.Due(2, 9, kNoon, kNoon));
  EXPECT_TRUE(schedule.Due(-1, 0, kNoon, kNoon));  // floor division below zero
  EXPECT_FALSE(schedule.Due(-2, -1, kNoon, kNoon));
}

TEST(DrainScheduleTest, EverySecondsDrainsTheFirstCommitAfterEachMultipleOfThePeriod) {
  const DrainSchedule schedule(0, 60);
  EXPECT_FALSE(schedule.Due(1, 2, kNoon, kNoon + absl::Seconds(19)));  // same minute
  EXPECT_TRUE(schedule.Due(1, 2, kNoon, kNoon + absl::Seconds(20)));   // the next minute began
  EXPECT_TRUE(schedule.Due(1, 2, kNoon, kNoon + absl::Hours(1)));
  // Two nodes committing the same step a few milliseconds apart agree, the boundary aside.
  EXPECT_EQ(schedule.Due(5, 6, kNoon, kNoon + absl::Seconds(10)),
            schedule.Due(5, 6, kNoon + absl::Milliseconds(3), kNoon + absl::Seconds(10.003)));
  EXPECT_FALSE(schedule.Due(std::nullopt, 1, kNoon, kNoon));  // the period rule only
}

TEST(DrainScheduleTest, BothRulesDrainWhenEitherIsDue) {
  const DrainSchedule schedule(10, 60);
  EXPECT_TRUE(schedule.Due(9, 10, kNoon, kNoon));
  EXPECT_TRUE(schedule.Due(11, 12, kNoon, kNoon + absl::Seconds(30)));
  EXPECT_FALSE(schedule.Due(11, 12, kNoon, kNoon + absl::Seconds(5)));
}

TEST(DrainScheduleTest, NoRuleDrainsNothing) {
  const DrainSchedule schedule(0, 0);
  EXPECT_FALSE(schedule.Due(std::nullopt, 1, kNoon, kNoon + absl::Hours(10)));
}

}  // namespace
}  // namespace moesnap::daemon::durable
