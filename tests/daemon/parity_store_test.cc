// ParityStore: a step's parity units opened, filled by the data nodes' frames and committed; a
// sparse step copies only the units of stripes whose data changed and shares the others, and
// encodes afresh the stripes whose data all changed; deltas in frames of any length update every
// byte of a unit of several frames.
#include "daemon/parity_store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "erasure/crc32c.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_pool.h"

namespace moesnap::daemon {
namespace {

constexpr uint64_t kUnitBytes = 4096;

// The header of a frame of data unit `index` of `stripe` (its delta in a delta step), from offset 0.
FrameHeader DataHeader(int64_t step, uint64_t stripe, int index) {
  FrameHeader header;
  header.kind = FrameKind::kParityDelta;
  header.step = step;
  header.attempt = 1;
  header.stripe = stripe;
  header.stripe_unit = static_cast<uint32_t>(index);
  return header;
}

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
    FrameHeader header = DataHeader(step, stripe, index);
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
  StepChanges changes{.units = std::vector<std::vector<bool>>(3, std::vector<bool>(4, false)),
                      .fresh_stripes = {}};
  const int data_position = layout_.Members(changed_stripe).data_positions[0];
  changes.units[data_position][layout_.DataUnitOf(data_position, changed_stripe)] = true;
  ASSERT_OK(parity_->Begin(2, 1, sizes_, &changes));
  // Only the changed stripe's unit takes new pool memory.
  EXPECT_EQ(parity_->in_flight_bytes(), kUnitBytes);
  // Nothing is expected of a shared unit: a frame for it is refused and writes nothing.
  const absl::Status refused = Send(2, unchanged_stripe, 0, 0xee);
  EXPECT_STATUS(refused, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.message(), "data unit 0: nothing of it is expected"))
      << refused;
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
  StepChanges changes{.units = std::vector<std::vector<bool>>(3, std::vector<bool>(4, false)),
                      .fresh_stripes = {}};
  const int data_position = layout_.Members(held_[0]).data_positions[0];
  changes.units[data_position][layout_.DataUnitOf(data_position, held_[0])] = true;
  ASSERT_OK(parity_->Begin(2, 1, sizes_, &changes));
  ASSERT_OK(parity_->Begin(2, 2, sizes_, &changes));  // a new coordinator opens it again
  EXPECT_OK(Send(2, held_[0], 0, 0x11));  // attempt 1's frame: dropped
  FrameHeader header = DataHeader(2, held_[0], 0);
  header.attempt = 2;
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

// A member's connection closed over a bad frame loses the deltas behind it: a step still waiting
// for that member's data fails at once, with the reason, instead of waiting out its deadline; a
// step that has all of that member's data waits on for the others', a complete one is untouched,
// and a step opened after it waits as usual.
TEST_F(ParityStoreTest, AStepWaitingForAMembersDataFailsAtOnceWhenItsConnectionClosed) {
  ASSERT_OK(parity_->Begin(1, 1, sizes_, nullptr));
  for (uint64_t stripe : held_) {
    for (int index = 0; index < layout_.data_units(); ++index) ASSERT_OK(Send(1, stripe, index, 7));
  }
  // Step 2 has every frame of the group's first data node, none of the second's.
  std::vector<int> others;
  for (int position = 0; position < layout_.group_size(); ++position) {
    if (position != position_) others.push_back(position);
  }
  ASSERT_EQ(others.size(), 2u);
  ASSERT_OK(parity_->Begin(2, 1, sizes_, nullptr));
  for (uint64_t stripe : held_) {
    const std::vector<int> data = layout_.Members(stripe).data_positions;
    const auto index = std::find(data.begin(), data.end(), others[0]) - data.begin();
    ASSERT_OK(Send(2, stripe, static_cast<int>(index), 9));
  }
  parity_->FailIncomplete({others[0]}, "the first node's frames were lost");
  EXPECT_STATUS(parity_->WaitComplete(2, absl::Now() + absl::Milliseconds(1)),
                absl::StatusCode::kDeadlineExceeded);
  parity_->FailIncomplete({others[1]}, "the second node's frames were lost");
  const absl::Status failed = parity_->WaitComplete(2, absl::InfiniteFuture());
  EXPECT_STATUS(failed, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(failed.message(),
                                "parity of step 2: the second node's frames were lost"))
      << failed;
  EXPECT_OK(parity_->WaitComplete(1, absl::Now()));
  parity_->Discard(2);
  ASSERT_OK(parity_->Begin(3, 1, sizes_, nullptr));
  EXPECT_STATUS(parity_->WaitComplete(3, absl::Now() + absl::Milliseconds(1)),
                absl::StatusCode::kDeadlineExceeded);
}

// Each byte of a data unit arrives once: its frame sent twice, or a frame overlapping one that
// arrived, is refused rather than counted for the bytes still missing (which would leave the parity
// missing them while called complete); so is a frame reaching past the unit.
TEST_F(ParityStoreTest, EachByteOfADataUnitIsTakenOnce) {
  ASSERT_OK(parity_->Begin(1, 1, sizes_, nullptr));
  auto send = [&](int index, uint64_t offset, uint64_t length) {
    const std::vector<uint8_t> payload(length, 7);
    FrameHeader header = DataHeader(1, held_[0], index);
    header.offset = offset;
    header.length = static_cast<uint32_t>(length);
    return parity_->Accept(header, payload);
  };
  ASSERT_OK(send(0, 0, 1024));
  for (const auto& [offset, length] : {std::pair<uint64_t, uint64_t>{0, 1024}, {512, 1024},
                                      {1000, 4}, {0, kUnitBytes}}) {
    const absl::Status twice = send(0, offset, length);
    EXPECT_STATUS(twice, absl::StatusCode::kInvalidArgument) << offset << "+" << length;
    EXPECT_TRUE(absl::StrContains(twice.message(), "arrived already")) << twice;
  }
  ASSERT_OK(send(0, 1024, 1024));  // beside the first, not over it
  ASSERT_OK(send(1, 0, kUnitBytes));
  const absl::Status past = send(0, 2048, kUnitBytes);
  EXPECT_STATUS(past, absl::StatusCode::kInvalidArgument);
  ASSERT_OK(send(0, 2048, 2048));
}

TEST_F(ParityStoreTest, AnAbortedSparseStepLeavesTheSharedCommittedUnitsAsTheyWere) {
  CommitFirstStep();
  const std::optional<ParityUnit> before = parity_->Committed(held_[1]);
  ASSERT_TRUE(before);
  const uint32_t crc = erasure::Crc32c(before->extent->data(), before->bytes);
  StepChanges changes{.units = std::vector<std::vector<bool>>(3, std::vector<bool>(4, false)),
                      .fresh_stripes = {}};
  ASSERT_OK(parity_->Begin(2, 1, sizes_, &changes));  // nothing changed: every unit shared
  EXPECT_EQ(parity_->in_flight_bytes(), 0u);
  parity_->Discard(2);
  const std::optional<ParityUnit> after = parity_->Committed(held_[1]);
  ASSERT_TRUE(after);
  EXPECT_EQ(after->extent, before->extent);
  EXPECT_EQ(erasure::Crc32c(after->extent->data(), after->bytes), crc);
  EXPECT_EQ(after->crc, crc);
}

// A stripe whose data units all changed is encoded afresh: its unit starts at zero and takes the
// units themselves, while a stripe with one unit changed is the committed unit plus that delta.
TEST_F(ParityStoreTest, AFreshStripeIsEncodedFromItsNewUnitsAndADeltaStripeFromTheCommittedUnit) {
  CommitFirstStep();
  const uint64_t fresh_stripe = held_[0];
  const uint64_t delta_stripe = held_[1];
  const std::optional<ParityUnit> committed = parity_->Committed(delta_stripe);
  ASSERT_TRUE(committed);
  std::vector<uint8_t> expected_delta(committed->extent->data(),
                                      committed->extent->data() + committed->bytes);
  StepChanges changes{.units = std::vector<std::vector<bool>>(3, std::vector<bool>(4, false)),
                      .fresh_stripes = std::vector<bool>(layout_.StripeCount(sizes_), false)};
  for (int position : layout_.Members(fresh_stripe).data_positions) {
    changes.units[position][layout_.DataUnitOf(position, fresh_stripe)] = true;
  }
  changes.fresh_stripes[fresh_stripe] = true;
  const int delta_position = layout_.Members(delta_stripe).data_positions[1];
  changes.units[delta_position][layout_.DataUnitOf(delta_position, delta_stripe)] = true;
  ASSERT_OK(parity_->Begin(2, 1, sizes_, &changes));

  std::vector<uint8_t> expected_fresh(kUnitBytes, 0);
  for (int index = 0; index < layout_.data_units(); ++index) {
    const uint8_t fill = static_cast<uint8_t>(0xa0 + index);
    ASSERT_OK(Send(2, fresh_stripe, index, fill));
    const std::vector<uint8_t> unit(kUnitBytes, fill);
    ASSERT_OK(codec_->UpdateParityUnit(index, 0, unit.data(), expected_fresh.data(), kUnitBytes));
  }
  ASSERT_OK(Send(2, delta_stripe, 1, 0x3c));
  const std::vector<uint8_t> delta(kUnitBytes, 0x3c);
  ASSERT_OK(codec_->UpdateParityUnit(1, 0, delta.data(), expected_delta.data(), kUnitBytes));
  ASSERT_OK(parity_->WaitComplete(2, absl::Now() + absl::Seconds(5)));
  parity_->Commit(2);

  auto bytes_of = [&](uint64_t stripe) {
    const std::optional<ParityUnit> unit = parity_->Committed(stripe);
    return std::vector<uint8_t>(unit->extent->data(), unit->extent->data() + unit->bytes);
  };
  EXPECT_TRUE(bytes_of(fresh_stripe) == expected_fresh);
  EXPECT_TRUE(bytes_of(delta_stripe) == expected_delta);
}

// A unit is written only by its frames, from zeros or from the committed unit, so its bytes must
// not depend on what the pool held before. In a pool first filled with other bytes: a whole encode
// of a stripe with a short data unit gives the encode of its units zero-padded, each sent in two
// frames; a delta of the short unit leaves the parity bytes past it as committed (no frame reaches
// them). A frame reaching past the short unit, though not past the parity unit, is refused.
TEST_F(ParityStoreTest, FramesAndBytesNoFrameReachedGiveTheUnitAsAddedInPlace) {
  {
    absl::StatusOr<std::shared_ptr<PoolExtent>> all = pool_.get()->Allocate(
        pool_.get()->free_bytes());
    ASSERT_OK(all);
    std::memset((*all)->data(), 0xa5, (*all)->bytes());
  }
  const uint64_t stripe = held_[0];
  const int short_position = layout_.Members(stripe).data_positions[1];
  const uint64_t short_unit = layout_.DataUnitOf(short_position, stripe);
  constexpr uint64_t kShortBytes = kUnitBytes - 1000;
  std::vector<uint64_t> sizes = sizes_;
  sizes[short_position] = short_unit * kUnitBytes + kShortBytes;
  ASSERT_EQ(layout_.UnitLength(sizes[short_position], short_unit), kShortBytes);
  struct Frame {
    int index;
    uint64_t offset, length;
    uint8_t fill;
  };
  auto accept = [&](int64_t step, uint64_t of_stripe, const Frame& frame) {
    const std::vector<uint8_t> payload(frame.length, frame.fill);
    FrameHeader header = DataHeader(step, of_stripe, frame.index);
    header.offset = frame.offset;
    header.length = static_cast<uint32_t>(frame.length);
    return parity_->Accept(header, payload);
  };
  // Sends the frames, and adds them in place into `expected` as a copy of the start takes them.
  auto send = [&](int64_t step, const std::vector<Frame>& frames, std::vector<uint8_t>& expected) {
    for (const Frame& frame : frames) {
      ASSERT_OK(accept(step, stripe, frame));
      const std::vector<uint8_t> payload(frame.length, frame.fill);
      ASSERT_OK(codec_->UpdateParityUnit(frame.index, 0, payload.data(),
                                         expected.data() + frame.offset, frame.length));
    }
  };
  auto committed_bytes = [&] {
    const std::optional<ParityUnit> unit = parity_->Committed(stripe);
    EXPECT_TRUE(unit.has_value());
    if (!unit) return std::vector<uint8_t>();
    EXPECT_EQ(unit->crc, erasure::Crc32c(unit->extent->data(), unit->bytes));
    return std::vector<uint8_t>(unit->extent->data(), unit->extent->data() + unit->bytes);
  };

  // A whole encode. A frame of no bytes reaches nothing and is refused.
  ASSERT_OK(parity_->Begin(1, 1, sizes, nullptr));
  EXPECT_STATUS(parity_->Accept(DataHeader(1, stripe, 0), {}), absl::StatusCode::kInvalidArgument);
  const absl::Status past = accept(1, stripe, {1, kShortBytes, 1000, 0x99});
  EXPECT_STATUS(past, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(past.message(), absl::StrCat("do not fit its ", kShortBytes)))
      << past;
  std::vector<uint8_t> expected(kUnitBytes, 0);
  send(1,
       {{0, 0, 2048, 0x11}, {1, 0, 1000, 0x22}, {0, 2048, 2048, 0x33},
        {1, 1000, kShortBytes - 1000, 0x44}},
       expected);
  for (uint64_t other : held_) {
    if (other == stripe || other >= layout_.StripeCount(sizes)) continue;
    const std::vector<int> data = layout_.Members(other).data_positions;
    for (size_t index = 0; index < data.size(); ++index) {
      const uint64_t length =
          layout_.UnitLength(sizes[data[index]], layout_.DataUnitOf(data[index], other));
      if (length > 0) ASSERT_OK(accept(1, other, {static_cast<int>(index), 0, length, 7}));
    }
  }
  ASSERT_OK(parity_->WaitComplete(1, absl::Now() + absl::Seconds(5)));
  parity_->Commit(1);
  EXPECT_TRUE(committed_bytes() == expected);

  // A delta of the short unit in two frames; the parity's last 1,000 bytes keep the committed ones.
  StepChanges changes{.units = std::vector<std::vector<bool>>(3, std::vector<bool>(4, false)),
                      .fresh_stripes = {}};
  changes.units[short_position][short_unit] = true;
  ASSERT_OK(parity_->Begin(2, 1, sizes, &changes));
  send(2, {{1, 2000, kShortBytes - 2000, 0x5a}, {1, 0, 2000, 0xc3}}, expected);
  ASSERT_OK(parity_->WaitComplete(2, absl::Now() + absl::Seconds(5)));
  parity_->Commit(2);
  EXPECT_TRUE(committed_bytes() == expected);
}

// A frame that fits no unit is refused before any wait for its step: were it to wait, it would
// wait the store's hour.
TEST_F(ParityStoreTest, AFrameOutsideAnyUnitIsRefusedBeforeAnyWaitForItsStep) {
  parity_ = std::make_unique<ParityStore>(pool_.get(), codec_.get(), &layout_, position_,
                                          absl::Hours(1));
  const std::vector<uint8_t> payload(64, 1);
  for (uint64_t offset : {std::numeric_limits<uint64_t>::max() - 63, kUnitBytes - 32}) {
    FrameHeader header = DataHeader(2, held_[0], 0);
    header.offset = offset;
    header.length = static_cast<uint32_t>(payload.size());
    const absl::Status refused = parity_->Accept(header, payload);
    EXPECT_STATUS(refused, absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(refused.message(), "do not fit a unit")) << refused;
  }
  FrameHeader header = DataHeader(2, held_[0], layout_.data_units());
  header.length = static_cast<uint32_t>(payload.size());
  EXPECT_STATUS(parity_->Accept(header, payload), absl::StatusCode::kInvalidArgument);
}

// A node that accumulates a step's change (it rebuilds) takes deltas only: a stripe it holds
// cannot be fresh.
TEST_F(ParityStoreTest, AnAccumulationRefusesAFreshStripe) {
  StepChanges changes{.units = std::vector<std::vector<bool>>(3, std::vector<bool>(4, true)),
                      .fresh_stripes = std::vector<bool>(layout_.StripeCount(sizes_), false)};
  changes.fresh_stripes[held_[0]] = true;
  const absl::Status refused = parity_->Begin(2, 1, sizes_, &changes, /*accumulate=*/true);
  EXPECT_STATUS(refused, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.message(), "afresh")) << refused;
}

// Units of 1 MiB, a data unit of the stripe 300,000 bytes short: step 2 changes the short one only
// (the parity past its end stays the committed bytes), step 3 changes both (two deltas add up in
// the same bytes). The deltas go in frames of odd lengths; every byte must be the committed parity
// plus the deltas, and the unchanged stripes keep their committed units.
TEST(ParityStoreDeltaTest, DeltasInFramesOfOddLengthsUpdateEveryByteOfTheCommittedUnit) {
  constexpr uint64_t kUnit = 1 << 20;
  const testing::TestPool pool(16 << 20);
  absl::StatusOr<std::unique_ptr<erasure::ReedSolomon>> codec = erasure::ReedSolomon::Create(2, 1);
  ASSERT_OK(codec);
  const erasure::StripeLayout layout = *erasure::StripeLayout::Create(2, 1, kUnit);
  // Position 2's last unit is 300,000 bytes short of a whole one.
  const std::vector<uint64_t> sizes = {4 * kUnit, 4 * kUnit, 4 * kUnit - 300000};
  std::optional<uint64_t> stripe;
  for (uint64_t candidate = 0; candidate < layout.StripeCount(sizes) && !stripe; ++candidate) {
    for (int position : layout.Members(candidate).data_positions) {
      if (layout.UnitLength(sizes[position], layout.DataUnitOf(position, candidate)) < kUnit) {
        stripe = candidate;
      }
    }
  }
  ASSERT_TRUE(stripe.has_value()) << "no stripe holds the short unit";
  const erasure::StripeMembers members = layout.Members(*stripe);
  ParityStore parity(pool.get(), codec->get(), &layout, members.parity_positions[0],
                     absl::Seconds(5));
  std::mt19937 random(7);
  // Sends `bytes` as data unit `index` of stripe `on` in frames of the lengths given in turn
  // (the last repeated).
  auto send = [&](int64_t step, uint64_t on, int index, const std::vector<uint8_t>& bytes,
                  const std::vector<uint64_t>& lengths) -> absl::Status {
    FrameHeader header = DataHeader(step, on, index);
    for (size_t i = 0; header.offset < bytes.size(); ++i) {
      const uint64_t length =
          std::min<uint64_t>(lengths[std::min(i, lengths.size() - 1)], bytes.size() - header.offset);
      header.length = static_cast<uint32_t>(length);
      if (absl::Status status = parity.Accept(
              header, absl::MakeConstSpan(bytes.data() + header.offset, length));
          !status.ok()) {
        return status;
      }
      header.offset += length;
    }
    return absl::OkStatus();
  };
  auto random_bytes = [&](uint64_t length) {
    std::vector<uint8_t> bytes(length);
    for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(random());
    return bytes;
  };
  auto length_of = [&](int index) {
    const int position = members.data_positions[index];
    return layout.UnitLength(sizes[position], layout.DataUnitOf(position, *stripe));
  };

  // Step 1 encodes every stripe this node holds whole.
  ASSERT_OK(parity.Begin(1, 1, sizes, nullptr));
  std::vector<uint64_t> held;
  for (uint64_t each = 0; each < layout.StripeCount(sizes); ++each) {
    if (!layout.IsParityPosition(each, members.parity_positions[0])) continue;
    held.push_back(each);
    const erasure::StripeMembers of = layout.Members(each);
    for (int index = 0; index < layout.data_units(); ++index) {
      const int position = of.data_positions[index];
      const uint64_t length = layout.UnitLength(sizes[position], layout.DataUnitOf(position, each));
      if (length > 0) {
        ASSERT_OK(send(1, each, index, random_bytes(length), {kUnit}));
      }
    }
  }
  ASSERT_OK(parity.WaitComplete(1, absl::Now() + absl::Seconds(5)));
  parity.Commit(1);
  std::map<uint64_t, std::vector<uint8_t>> before;
  for (uint64_t each : held) {
    const std::optional<ParityUnit> unit = parity.Committed(each);
    ASSERT_TRUE(unit.has_value()) << "stripe " << each;
    before[each].assign(unit->extent->data(), unit->extent->data() + unit->bytes);
  }

  // Step 2 changes the short data unit only, step 3 both.
  const int short_index = length_of(0) < kUnit ? 0 : 1;
  const std::vector<uint64_t> frames[] = {{100000, 300001}, {262151, 524287}};
  for (const std::vector<int>& changed : {std::vector<int>{short_index}, std::vector<int>{0, 1}}) {
    const int64_t step = changed.size() == 1 ? 2 : 3;
    StepChanges changes{.units = std::vector<std::vector<bool>>(3, std::vector<bool>(4, false)),
                        .fresh_stripes = {}};
    for (int index : changed) {
      const int position = members.data_positions[index];
      changes.units[position][layout.DataUnitOf(position, *stripe)] = true;
    }
    ASSERT_OK(parity.Begin(step, 1, sizes, &changes));
    std::vector<uint8_t> expected = before[*stripe];
    for (int index : changed) {
      const std::vector<uint8_t> delta = random_bytes(length_of(index));
      ASSERT_OK(send(step, *stripe, index, delta, frames[index]));
      ASSERT_OK(codec->get()->UpdateParityUnit(index, 0, delta.data(), expected.data(),
                                               delta.size()));
    }
    ASSERT_OK(parity.WaitComplete(step, absl::Now() + absl::Seconds(5)));
    parity.Commit(step);
    before[*stripe] = expected;
    for (uint64_t each : held) {
      const std::optional<ParityUnit> unit = parity.Committed(each);
      ASSERT_TRUE(unit.has_value()) << "stripe " << each;
      const std::vector<uint8_t> after(unit->extent->data(), unit->extent->data() + unit->bytes);
      EXPECT_TRUE(after == before[each]) << "step " << step << ", stripe " << each;
      EXPECT_EQ(unit->crc, erasure::Crc32c(after.data(), after.size()))
          << "step " << step << ", stripe " << each;
    }
  }
}

}  // namespace
}  // namespace moesnap::daemon
