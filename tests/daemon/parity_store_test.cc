// ParityStore: a step's parity units opened, filled by the data nodes' frames and committed; a
// sparse step copies only the units of stripes whose data changed and shares the others.
#include "daemon/parity_store.h"

#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "erasure/crc32c.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_pool.h"

namespace moesnap::daemon {
namespace {

constexpr uint64_t kUnitBytes = 4096;

class ParityStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<erasure::ReedSolomon>> codec =
        erasure::ReedSolomon::Create(2, 1);
    ASSERT_OK(codec);
    codec_ = *std::move(codec);
    // The parity holder of stripe 0; with three nodes of four units it holds several stripes.
    position_ = layout_.Members(0).parity_positions[0];
    parity_ = std::make_unique<ParityStore>(pool_.get(), codec_.get(), &layout_, position_,
                                            absl::Seconds(5));
    for (uint64_t stripe = 0; stripe < layout_.StripeCount(sizes_); ++stripe) {
      if (layout_.IsParityPosition(stripe, position_)) held_.push_back(stripe);
    }
    ASSERT_GE(held_.size(), 2u);
  }

  // Unit `index` of `stripe` (its delta in a delta step) as a data node sends it.
  absl::Status Send(int64_t step, uint64_t stripe, int index, uint8_t fill) {
    const std::vector<uint8_t> payload(kUnitBytes, fill);
    FrameHeader header;
    header.kind = FrameKind::kParityDelta;
    header.step = step;
    header.attempt = 1;
    header.stripe = stripe;
    header.stripe_unit = static_cast<uint32_t>(index);
    header.length = static_cast<uint32_t>(payload.size());
    return parity_->Accept(header, payload);
  }

  // Commits step 1 as a whole encode: every data unit of every stripe held.
  void CommitFirstStep() {
    ASSERT_OK(parity_->Begin(1, 1, sizes_, nullptr));
    for (uint64_t stripe : held_) {
      for (int index = 0; index < layout_.data_units(); ++index) {
        ASSERT_OK(Send(1, stripe, index, static_cast<uint8_t>(stripe * 16 + index + 1)));
      }
    }
    ASSERT_OK(parity_->WaitComplete(1, absl::Now() + absl::Seconds(5)));
    parity_->Commit(1);
  }

  const testing::TestPool pool_{1 << 20};  // declared first: it outlives the parity store
  std::unique_ptr<erasure::ReedSolomon> codec_;
  const erasure::StripeLayout layout_ = *erasure::StripeLayout::Create(2, 1, kUnitBytes);
  const std::vector<uint64_t> sizes_ = {4 * kUnitBytes, 4 * kUnitBytes, 4 * kUnitBytes};
  int position_ = 0;
  std::unique_ptr<ParityStore> parity_;
  std::vector<uint64_t> held_;  // stripes whose parity this node holds
};

TEST_F(ParityStoreTest, ASparseStepSharesTheCommittedUnitsOfStripesWhoseDataDidNotChange) {
  CommitFirstStep();
  const uint64_t changed_stripe = held_[0];
  const uint64_t unchanged_stripe = held_[1];
  const std::optional<ParityUnit> before = parity_->Committed(unchanged_stripe);
  const std::optional<ParityUnit> changed_before = parity_->Committed(changed_stripe);
  ASSERT_TRUE(before && changed_before);
  const std::vector<uint8_t> unchanged_bytes(before->extent->data(),
                                             before->extent->data() + before->bytes);

  // Step 2 changes one data unit, of `changed_stripe`.
  std::vector<std::vector<bool>> changed(3, std::vector<bool>(4, false));
  const int data_position = layout_.Members(changed_stripe).data_positions[0];
  changed[data_position][layout_.DataUnitOf(data_position, changed_stripe)] = true;
  ASSERT_OK(parity_->Begin(2, 1, sizes_, &changed));
  // Only the changed stripe's unit takes new pool memory.
  EXPECT_EQ(parity_->in_flight_bytes(), kUnitBytes);
  // Nothing is expected of a shared unit: a frame for it is refused and writes nothing.
  const absl::Status refused = Send(2, unchanged_stripe, 0, 0xee);
  EXPECT_STATUS(refused, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.message(), "more data than its units hold")) << refused;
  ASSERT_OK(Send(2, changed_stripe, 0, 0x5a));
  ASSERT_OK(parity_->WaitComplete(2, absl::Now() + absl::Seconds(5)));

  std::map<uint64_t, v1::JournalParity> records;
  for (const v1::JournalParity& record : parity_->Records(2)) records[record.stripe()] = record;
  ASSERT_EQ(records.size(), held_.size());
  EXPECT_EQ(records[unchanged_stripe].pool_offset(), before->extent->offset());
  EXPECT_EQ(records[unchanged_stripe].crc(), before->crc);
  EXPECT_NE(records[changed_stripe].pool_offset(), changed_before->extent->offset());
  EXPECT_NE(records[changed_stripe].crc(), changed_before->crc);

  parity_->Commit(2);
  const std::optional<ParityUnit> after = parity_->Committed(unchanged_stripe);
  ASSERT_TRUE(after);
  EXPECT_EQ(after->extent, before->extent);  // the very same unit, never copied
  EXPECT_EQ(std::vector<uint8_t>(after->extent->data(), after->extent->data() + after->bytes),
            unchanged_bytes);
  const std::optional<ParityUnit> changed_after = parity_->Committed(changed_stripe);
  ASSERT_TRUE(changed_after);
  EXPECT_EQ(changed_after->crc, erasure::Crc32c(changed_after->extent->data(), kUnitBytes));
  EXPECT_EQ(parity_->committed_bytes(), held_.size() * kUnitBytes);
}

TEST_F(ParityStoreTest, ANewerAttemptOfASparseStepSharesTheCommittedUnitsAgain) {
  CommitFirstStep();
  const std::optional<ParityUnit> before = parity_->Committed(held_[1]);
  ASSERT_TRUE(before);
  std::vector<std::vector<bool>> changed(3, std::vector<bool>(4, false));
  const int data_position = layout_.Members(held_[0]).data_positions[0];
  changed[data_position][layout_.DataUnitOf(data_position, held_[0])] = true;
  ASSERT_OK(parity_->Begin(2, 1, sizes_, &changed));
  ASSERT_OK(parity_->Begin(2, 2, sizes_, &changed));  // a new coordinator opens it again
  EXPECT_OK(Send(2, held_[0], 0, 0x11));  // attempt 1's frame: dropped
  FrameHeader header;
  header.kind = FrameKind::kParityDelta;
  header.step = 2;
  header.attempt = 2;
  header.stripe = held_[0];
  const std::vector<uint8_t> delta(kUnitBytes, 0x5a);
  header.length = static_cast<uint32_t>(delta.size());
  ASSERT_OK(parity_->Accept(header, delta));
  ASSERT_OK(parity_->WaitComplete(2, absl::Now() + absl::Seconds(5)));
  parity_->Commit(2);
  const std::optional<ParityUnit> after = parity_->Committed(held_[1]);
  ASSERT_TRUE(after);
  EXPECT_EQ(after->extent, before->extent);
  EXPECT_EQ(after->crc, before->crc);
  EXPECT_EQ(parity_->in_flight_bytes(), 0u);
}

TEST_F(ParityStoreTest, AnAbortedSparseStepLeavesTheSharedCommittedUnitsAsTheyWere) {
  CommitFirstStep();
  const std::optional<ParityUnit> before = parity_->Committed(held_[1]);
  ASSERT_TRUE(before);
  const uint32_t crc = erasure::Crc32c(before->extent->data(), before->bytes);
  std::vector<std::vector<bool>> changed(3, std::vector<bool>(4, false));
  ASSERT_OK(parity_->Begin(2, 1, sizes_, &changed));  // nothing changed: every unit shared
  EXPECT_EQ(parity_->in_flight_bytes(), 0u);
  parity_->Discard(2);
  const std::optional<ParityUnit> after = parity_->Committed(held_[1]);
  ASSERT_TRUE(after);
  EXPECT_EQ(after->extent, before->extent);
  EXPECT_EQ(erasure::Crc32c(after->extent->data(), after->bytes), crc);
  EXPECT_EQ(after->crc, crc);
}

}  // namespace
}  // namespace moesnap::daemon
