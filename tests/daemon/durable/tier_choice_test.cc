// Which tier serves a restore: memory while every node holds the committed state, the newest step
// recorded durable on every node when one does not, and "not yet" while that cannot be known.
#include "daemon/durable/tier_choice.h"

#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::durable {
namespace {

NodeMemory Node(uint32_t id, std::optional<int64_t> memory, bool settled = true) {
  return {id, memory, settled};
}

// The job's records say `step` is durable on every node; counts how often they were read.
struct Records {
  absl::StatusOr<DurableEverywhere> answer = DurableEverywhere{};
  int reads = 0;
  absl::StatusOr<DurableEverywhere> operator()() {
    ++reads;
    return answer;
  }
};

absl::StatusOr<TierChoice> Choose(const TierInputs& inputs, Records& records) {
  return ChooseTier(inputs, [&] { return records(); });
}

TEST(TierChoiceTest, ASingleNodeUsesMemoryWhileItHoldsTheRank) {
  TierInputs inputs;
  inputs.memory_here = true;
  inputs.durable_here = {4, 6};
  Records records;
  absl::StatusOr<TierChoice> choice = Choose(inputs, records);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_MEMORY);
  EXPECT_EQ(records.reads, 0);  // memory serves: the records are not needed
}

TEST(TierChoiceTest, AFreshPoolUsesTheNewestStepRecordedDurableOnEveryNode) {
  TierInputs inputs;
  inputs.durable_here = {4, 6};
  Records records{DurableEverywhere{4, "recorded by every node"}};
  absl::StatusOr<TierChoice> choice = Choose(inputs, records);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_DURABLE);
  EXPECT_EQ(choice->step, 4);  // 6 is on this disk, but not recorded everywhere
  EXPECT_NE(choice->reason.find("recorded by every node"), std::string::npos) << choice->reason;
}

TEST(TierChoiceTest, NothingAnywhereIsNothingToRestore) {
  Records records;
  absl::StatusOr<TierChoice> choice = Choose(TierInputs(), records);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_UNSPECIFIED);
}

TEST(TierChoiceTest, MoreLossesThanParityOnAnotherNodeMoveSurvivorsToDiskToo) {
  TierInputs inputs;
  inputs.memory_here = true;
  inputs.durable_here = {4, 6};
  inputs.peers.answered = {Node(1, 7), Node(2, std::nullopt)};
  Records records{DurableEverywhere{6, "recorded"}};
  absl::StatusOr<TierChoice> choice = Choose(inputs, records);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_DURABLE);
  EXPECT_EQ(choice->step, 6);
  EXPECT_NE(choice->reason.find("node 2"), std::string::npos) << choice->reason;
}

TEST(TierChoiceTest, MemoryOnEveryNodeThatAnswersStaysInMemory) {
  TierInputs inputs;
  inputs.memory_here = true;
  inputs.durable_here = {4};
  inputs.peers.answered = {Node(1, 7)};
  inputs.peers.silent = {{2, "connection refused"}};  // a node lost within the code's reach
  Records records{DurableEverywhere{4, "recorded"}};
  absl::StatusOr<TierChoice> choice = Choose(inputs, records);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_MEMORY);
}

TEST(TierChoiceTest, AFreshNodeNeedsNoAnswerFromItsPeersOnlyTheRecords) {
  TierInputs inputs;
  inputs.durable_here = {4};
  inputs.peers.silent = {{1, "deadline exceeded"}, {2, "connection refused"}};
  Records records{DurableEverywhere{4, "recorded"}};
  absl::StatusOr<TierChoice> choice = Choose(inputs, records);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_DURABLE);
  EXPECT_EQ(choice->step, 4);
}

TEST(TierChoiceTest, RecordsThatCannotBeReadDeferTheDecision) {
  TierInputs inputs;
  inputs.durable_here = {4};
  Records records{absl::UnavailableError("etcd cannot be reached")};
  absl::StatusOr<TierChoice> choice = Choose(inputs, records);
  ASSERT_STATUS(choice, absl::StatusCode::kUnavailable);
  EXPECT_NE(choice.status().message().find("etcd cannot be reached"), std::string::npos)
      << choice.status();
}

TEST(TierChoiceTest, ARecordedStepMissingFromThisDiskIsDataLossNotAnotherStep) {
  TierInputs inputs;
  inputs.durable_here = {2, 4};
  Records records{DurableEverywhere{6, "recorded"}};
  absl::StatusOr<TierChoice> choice = Choose(inputs, records);
  ASSERT_STATUS(choice, absl::StatusCode::kDataLoss);
  EXPECT_NE(choice.status().message().find("step 6"), std::string::npos) << choice.status();
}

TEST(TierChoiceTest, ANodeStillRebuildingDefersTheDecision) {
  TierInputs inputs;
  inputs.memory_here = true;
  inputs.durable_here = {4};
  inputs.peers.answered = {Node(1, std::nullopt, /*settled=*/false)};
  Records records{DurableEverywhere{4, "recorded"}};
  EXPECT_STATUS(Choose(inputs, records), absl::StatusCode::kUnavailable);
}

TEST(TierChoiceTest, NoStepRecordedOnEveryNodeFallsBackToWhatMemoryHas) {
  TierInputs inputs;
  inputs.memory_here = true;
  inputs.durable_here = {6};
  inputs.peers.answered = {Node(1, std::nullopt)};
  Records records{DurableEverywhere{std::nullopt, "node 1 records only step 4"}};
  absl::StatusOr<TierChoice> choice = Choose(inputs, records);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_MEMORY);
  EXPECT_NE(choice->reason.find("node 1 records only step 4"), std::string::npos) << choice->reason;
  inputs.memory_here = false;
  inputs.memory_problem = absl::DataLossError("group 0 lost 3 nodes");
  choice = Choose(inputs, records);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_UNSPECIFIED);
  EXPECT_NE(choice->reason.find("group 0 lost 3 nodes"), std::string::npos) << choice->reason;
}

}  // namespace
}  // namespace moesnap::daemon::durable
