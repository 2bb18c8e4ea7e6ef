// StepChanges: which stripes of a step are encoded afresh, as every node of a group decides it.
#include "daemon/step_changes.h"

#include <gtest/gtest.h>

#include <vector>

namespace moesnap::daemon {
namespace {

constexpr uint64_t kUnitBytes = 4096;

class StepChangesTest : public ::testing::Test {
 protected:
  // Every unit of every position marked `changed`.
  std::vector<std::vector<bool>> AllUnits(const std::vector<uint64_t>& sizes, bool changed) const {
    std::vector<std::vector<bool>> units;
    for (uint64_t bytes : sizes) units.emplace_back(layout_.UnitCount(bytes), changed);
    return units;
  }
  // The stripe that unit `unit` of position `position` lies in.
  uint64_t StripeOf(int position, uint64_t unit) const {
    return layout_.DataUnitLocation(position, unit).stripe;
  }

  const erasure::StripeLayout layout_ = *erasure::StripeLayout::Create(2, 1, kUnitBytes);
  const std::vector<uint64_t> sizes_ = {4 * kUnitBytes, 4 * kUnitBytes, 4 * kUnitBytes};
};

TEST_F(StepChangesTest, AStripeIsFreshWhenEveryDataUnitOfItChanged) {
  const StepChanges all = ChangesOf(layout_, AllUnits(sizes_, true), sizes_, {});
  ASSERT_EQ(all.fresh_stripes.size(), layout_.StripeCount(sizes_));
  for (uint64_t stripe = 0; stripe < all.fresh_stripes.size(); ++stripe) {
    EXPECT_TRUE(all.Fresh(stripe)) << "stripe " << stripe;
  }
  std::vector<std::vector<bool>> units = AllUnits(sizes_, true);
  units[1][2] = false;  // one unit kept: its stripe takes deltas
  const StepChanges one_kept = ChangesOf(layout_, units, sizes_, {});
  for (uint64_t stripe = 0; stripe < one_kept.fresh_stripes.size(); ++stripe) {
    EXPECT_EQ(one_kept.Fresh(stripe), stripe != StripeOf(1, 2)) << "stripe " << stripe;
  }
  EXPECT_TRUE(one_kept.Changed(0, 0));
  EXPECT_FALSE(one_kept.Changed(1, 2));
  EXPECT_FALSE(one_kept.Changed(1, 99));  // past the image's end: nothing there changed
  const StepChanges none = ChangesOf(layout_, AllUnits(sizes_, false), sizes_, {});
  for (uint64_t stripe = 0; stripe < none.fresh_stripes.size(); ++stripe) {
    EXPECT_FALSE(none.Fresh(stripe)) << "stripe " << stripe;
  }
}

// An absent parity holder (a node that rebuilds, accumulating the step's deltas) keeps every
// stripe it holds parity of from being fresh.
TEST_F(StepChangesTest, NoStripeIsFreshWhoseParityHolderIsAbsent) {
  const StepChanges changes = ChangesOf(layout_, AllUnits(sizes_, true), sizes_, {2});
  int fresh = 0;
  for (uint64_t stripe = 0; stripe < changes.fresh_stripes.size(); ++stripe) {
    EXPECT_EQ(changes.Fresh(stripe), !layout_.IsParityPosition(stripe, 2)) << "stripe " << stripe;
    fresh += changes.Fresh(stripe);
  }
  EXPECT_GT(fresh, 0);
}

// A unit past a short image's end holds nothing: it does not keep its stripe from being fresh.
TEST_F(StepChangesTest, AUnitPastAShortImagesEndDoesNotKeepItsStripeFromBeingFresh) {
  const std::vector<uint64_t> sizes = {4 * kUnitBytes, kUnitBytes, 4 * kUnitBytes};
  const StepChanges changes = ChangesOf(layout_, AllUnits(sizes, true), sizes, {});
  ASSERT_EQ(changes.fresh_stripes.size(), layout_.StripeCount(sizes));
  bool short_stripe_seen = false;
  for (uint64_t stripe = 0; stripe < changes.fresh_stripes.size(); ++stripe) {
    EXPECT_TRUE(changes.Fresh(stripe)) << "stripe " << stripe;
    for (int position : layout_.Members(stripe).data_positions) {
      const uint64_t unit = layout_.DataUnitOf(position, stripe);
      short_stripe_seen |= layout_.UnitLength(sizes[position], unit) == 0;
    }
  }
  EXPECT_TRUE(short_stripe_seen);
}

}  // namespace
}  // namespace moesnap::daemon
