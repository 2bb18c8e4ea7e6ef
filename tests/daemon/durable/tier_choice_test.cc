// Which tier serves a restore: memory while every node holds the committed state, the newest step
// durable on every node when one does not, and "not yet" while that cannot be known.
#include "daemon/durable/tier_choice.h"

#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::durable {
namespace {

NodeDurability Node(uint32_t id, std::vector<int64_t> durable, std::optional<int64_t> memory,
                    bool settled = true) {
  return {id, std::move(durable), memory, settled};
}

TEST(TierChoiceTest, ASingleNodeUsesMemoryWhileItHoldsTheRank) {
  TierInputs inputs;
  inputs.memory_here = true;
  inputs.durable_here = {4, 6};
  absl::StatusOr<TierChoice> choice = ChooseTier(inputs);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_MEMORY);
}

TEST(TierChoiceTest, ASingleNodeWithAFreshPoolUsesItsNewestDurableStep) {
  TierInputs inputs;
  inputs.durable_here = {4, 6};
  absl::StatusOr<TierChoice> choice = ChooseTier(inputs);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_DURABLE);
  EXPECT_EQ(choice->step, 6);
}

TEST(TierChoiceTest, NothingAnywhereIsNothingToRestore) {
  absl::StatusOr<TierChoice> choice = ChooseTier(TierInputs());
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_UNSPECIFIED);
}

TEST(TierChoiceTest, EveryNodeLostTakesTheNewestStepDurableOnEveryNode) {
  TierInputs inputs;
  inputs.durable_here = {2, 4, 6};
  inputs.peers.answered = {Node(1, {4, 6}, std::nullopt), Node(2, {2, 4}, std::nullopt)};
  absl::StatusOr<TierChoice> choice = ChooseTier(inputs);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_DURABLE);
  EXPECT_EQ(choice->step, 4);  // 6 is not on node 2
}

TEST(TierChoiceTest, MoreLossesThanParityOnAnotherNodeMoveSurvivorsToDiskToo) {
  TierInputs inputs;
  inputs.memory_here = true;
  inputs.durable_here = {4, 6};
  inputs.peers.answered = {Node(1, {4, 6}, 7), Node(2, {4, 6}, std::nullopt)};
  absl::StatusOr<TierChoice> choice = ChooseTier(inputs);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_DURABLE);
  EXPECT_EQ(choice->step, 6);
  EXPECT_NE(choice->reason.find("node 2"), std::string::npos) << choice->reason;
}

TEST(TierChoiceTest, MemoryOnEveryNodeThatAnswersStaysInMemory) {
  TierInputs inputs;
  inputs.memory_here = true;
  inputs.durable_here = {4};
  inputs.peers.answered = {Node(1, {4}, 7)};
  inputs.peers.silent = {{2, "connection refused"}};  // a node lost within the code's reach
  absl::StatusOr<TierChoice> choice = ChooseTier(inputs);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_MEMORY);
}

TEST(TierChoiceTest, AFreshNodeWaitsForSilentNodesBeforeTrustingADurableStep) {
  TierInputs inputs;
  inputs.durable_here = {4};
  inputs.peers.answered = {Node(1, {4}, std::nullopt)};
  inputs.peers.silent = {{2, "deadline exceeded"}};
  absl::StatusOr<TierChoice> choice = ChooseTier(inputs);
  ASSERT_STATUS(choice, absl::StatusCode::kUnavailable);
  EXPECT_NE(choice.status().message().find("2 (deadline exceeded)"), std::string::npos)
      << choice.status();
}

TEST(TierChoiceTest, ANodeStillRebuildingDefersTheDecision) {
  TierInputs inputs;
  inputs.memory_here = true;
  inputs.durable_here = {4};
  inputs.peers.answered = {Node(1, {4}, std::nullopt, /*settled=*/false)};
  EXPECT_STATUS(ChooseTier(inputs), absl::StatusCode::kUnavailable);
}

TEST(TierChoiceTest, NoCommonDurableStepFallsBackToWhatMemoryHas) {
  TierInputs inputs;
  inputs.memory_here = true;
  inputs.durable_here = {6};
  inputs.peers.answered = {Node(1, {4}, std::nullopt)};
  absl::StatusOr<TierChoice> choice = ChooseTier(inputs);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_MEMORY);
  inputs.memory_here = false;
  inputs.memory_problem = absl::DataLossError("group 0 lost 3 nodes");
  choice = ChooseTier(inputs);
  ASSERT_OK(choice);
  EXPECT_EQ(choice->tier, v1::TIER_UNSPECIFIED);
  EXPECT_NE(choice->reason.find("group 0 lost 3 nodes"), std::string::npos) << choice->reason;
}

TEST(TierChoiceTest, NewestCommonStepIntersectsEveryList) {
  const std::vector<int64_t> a = {1, 3, 5, 7}, b = {3, 5, 8}, c = {5, 3}, d = {};
  EXPECT_EQ(NewestCommonStep({&a, &b, &c}), 5);
  EXPECT_EQ(NewestCommonStep({&a, &d}), std::nullopt);
  EXPECT_EQ(NewestCommonStep({}), std::nullopt);
}

}  // namespace
}  // namespace moesnap::daemon::durable
