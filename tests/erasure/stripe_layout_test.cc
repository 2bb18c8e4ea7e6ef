// StripeLayout: every data unit has exactly one place, parity load is even, and a group whose nodes
// hold data of unequal lengths survives the loss of any m nodes: their data and parity are rebuilt
// from the survivors, bit-identical, with the short units padded only virtually.
#include "erasure/stripe_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "erasure/reed_solomon.h"
#include "tests/testing/deterministic_bytes.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::erasure {
namespace {

struct Shape {
  int k;
  int m;
};

const std::vector<Shape> kShapes = {{2, 1}, {4, 2}, {6, 3}, {10, 4}, {3, 3}, {5, 2}};

TEST(StripeLayoutTest, EveryDataUnitHasExactlyOnePlace) {
  for (Shape shape : kShapes) {
    absl::StatusOr<StripeLayout> layout = StripeLayout::Create(shape.k, shape.m, 4096);
    ASSERT_OK(layout);
    const int n = shape.k + shape.m;
    std::set<std::pair<uint64_t, int>> taken;
    for (int position = 0; position < n; ++position) {
      uint64_t previous_stripe = 0;
      for (uint64_t unit = 0; unit < 200; ++unit) {
        const UnitLocation location = layout->DataUnitLocation(position, unit);
        const StripeMembers members = layout->Members(location.stripe);
        ASSERT_EQ(members.data_positions[location.index], position);
        ASSERT_FALSE(layout->IsParityPosition(location.stripe, position));
        ASSERT_EQ(layout->DataUnitOf(position, location.stripe), unit);
        ASSERT_TRUE(taken.insert({location.stripe, location.index}).second);
        if (unit > 0) {
          ASSERT_GT(location.stripe, previous_stripe) << "units go in stripe order";
        }
        previous_stripe = location.stripe;
      }
    }
  }
}

TEST(StripeLayoutTest, MembersAreDisjointAndParityLoadIsEven) {
  for (Shape shape : kShapes) {
    absl::StatusOr<StripeLayout> layout = StripeLayout::Create(shape.k, shape.m, 64);
    ASSERT_OK(layout);
    const int n = shape.k + shape.m;
    std::vector<int> parity_count(n, 0);
    const int stripes = n * 12;
    for (int stripe = 0; stripe < stripes; ++stripe) {
      const StripeMembers members = layout->Members(stripe);
      ASSERT_EQ(members.data_positions.size(), static_cast<size_t>(shape.k));
      ASSERT_EQ(members.parity_positions.size(), static_cast<size_t>(shape.m));
      std::set<int> all(members.data_positions.begin(), members.data_positions.end());
      all.insert(members.parity_positions.begin(), members.parity_positions.end());
      ASSERT_EQ(all.size(), static_cast<size_t>(n));
      for (int position : members.parity_positions) ++parity_count[position];
    }
    for (int count : parity_count) EXPECT_EQ(count, stripes * shape.m / n);
  }
}

TEST(StripeLayoutTest, RejectsBadShapesAndUnits) {
  EXPECT_STATUS(StripeLayout::Create(0, 2, 4096), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(StripeLayout::Create(4, 0, 4096), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(StripeLayout::Create(250, 10, 4096), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(StripeLayout::Create(4, 2, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(StripeLayout::Create(4, 2, 100), absl::StatusCode::kInvalidArgument);
}

TEST(StripeLayoutTest, LengthsOfShortAndMissingUnits) {
  absl::StatusOr<StripeLayout> layout = StripeLayout::Create(4, 2, 1024);
  ASSERT_OK(layout);
  EXPECT_EQ(layout->UnitCount(0), 0u);
  EXPECT_EQ(layout->UnitCount(2049), 3u);
  EXPECT_EQ(layout->UnitLength(2049, 2), 1u);
  EXPECT_EQ(layout->UnitLength(2049, 3), 0u);
  const std::vector<uint64_t> lengths = {0, 1024, 5000, 1, 0, 0};
  const uint64_t stripes = layout->StripeCount(lengths);
  for (int position = 0; position < 6; ++position) {
    const uint64_t units = layout->UnitCount(lengths[position]);
    if (units > 0) {
      EXPECT_LT(layout->DataUnitLocation(position, units - 1).stripe, stripes);
    }
  }
}

// A whole group in memory: each node's data, and the parity units each node stores.
class Group {
 public:
  Group(const StripeLayout& layout, const ReedSolomon& codec, std::vector<std::vector<uint8_t>> data)
      : layout_(layout), codec_(codec), data_(std::move(data)) {
    for (const auto& bytes : data_) lengths_.push_back(bytes.size());
    stripes_ = layout_.StripeCount(lengths_);
  }

  // Parity of every stripe, keyed by (stripe, parity index).
  std::map<std::pair<uint64_t, int>, std::vector<uint8_t>> Encode() const {
    std::map<std::pair<uint64_t, int>, std::vector<uint8_t>> parity;
    for (uint64_t stripe = 0; stripe < stripes_; ++stripe) {
      const uint64_t length = layout_.ParityLength(stripe, lengths_);
      if (length == 0) continue;
      std::vector<std::vector<uint8_t>> units = DataUnits(stripe, length);
      std::vector<const uint8_t*> inputs;
      for (auto& unit : units) inputs.push_back(unit.data());
      std::vector<std::vector<uint8_t>> outputs(layout_.parity_units(), std::vector<uint8_t>(length));
      std::vector<uint8_t*> output_pointers;
      for (auto& unit : outputs) output_pointers.push_back(unit.data());
      EXPECT_OK(codec_.Encode(inputs, output_pointers, length));
      for (int j = 0; j < layout_.parity_units(); ++j) parity[{stripe, j}] = outputs[j];
    }
    return parity;
  }

  // The stripe's data units, each zero-padded (virtually, in a scratch copy) to `length`.
  std::vector<std::vector<uint8_t>> DataUnits(uint64_t stripe, uint64_t length) const {
    std::vector<std::vector<uint8_t>> units;
    for (int position : layout_.Members(stripe).data_positions) {
      std::vector<uint8_t> unit(length, 0);
      const uint64_t index = layout_.DataUnitOf(position, stripe);
      const uint64_t unit_length = layout_.UnitLength(lengths_[position], index);
      // A unit past the end of a short node's data holds nothing (no iterator past its end).
      if (unit_length > 0) {
        std::copy_n(data_[position].begin() + index * layout_.unit_bytes(), unit_length, unit.begin());
      }
      units.push_back(std::move(unit));
    }
    return units;
  }

  uint64_t stripes() const { return stripes_; }
  const std::vector<uint64_t>& lengths() const { return lengths_; }

 private:
  const StripeLayout& layout_;
  const ReedSolomon& codec_;
  std::vector<std::vector<uint8_t>> data_;
  std::vector<uint64_t> lengths_;
  uint64_t stripes_ = 0;
};

TEST(StripeLayoutTest, AnyMLostNodesAreRebuiltFromTheSurvivors) {
  constexpr int k = 4, m = 2, n = 6;
  constexpr uint64_t kUnit = 4096;
  absl::StatusOr<StripeLayout> layout = StripeLayout::Create(k, m, kUnit);
  absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(k, m);
  ASSERT_OK(layout);
  ASSERT_OK(codec);
  testing::DeterministicBytes random(99);
  std::vector<std::vector<uint8_t>> data;
  for (int position = 0; position < n; ++position) {
    // Unequal lengths, one node empty, most ending in a short unit.
    const uint64_t bytes = position == 3 ? 0 : 30 * kUnit + random.Next() % (40 * kUnit);
    data.push_back(random.Bytes(bytes));
  }
  const Group group(*layout, **codec, data);
  const auto parity = group.Encode();

  for (int first = 0; first < n; ++first) {
    for (int second = first + 1; second < n; ++second) {
      const std::set<int> lost = {first, second};
      std::vector<std::vector<uint8_t>> rebuilt(n);
      for (int position : lost) rebuilt[position].assign(data[position].size(), 0);
      for (uint64_t stripe = 0; stripe < group.stripes(); ++stripe) {
        const uint64_t length = layout->ParityLength(stripe, group.lengths());
        if (length == 0) continue;
        const StripeMembers members = layout->Members(stripe);
        // Survivors contribute what they hold; lost units are outputs.
        std::vector<std::vector<uint8_t>> units = group.DataUnits(stripe, length);
        for (int j = 0; j < m; ++j) units.push_back(parity.at({stripe, j}));
        std::vector<int> erased;
        for (int i = 0; i < k; ++i) {
          if (lost.contains(members.data_positions[i])) erased.push_back(i);
        }
        for (int j = 0; j < m; ++j) {
          if (lost.contains(members.parity_positions[j])) erased.push_back(k + j);
        }
        const std::vector<std::vector<uint8_t>> expected = units;
        for (int unit : erased) std::fill(units[unit].begin(), units[unit].end(), 0xEE);
        std::vector<uint8_t*> pointers;
        for (auto& unit : units) pointers.push_back(unit.data());
        ASSERT_OK((*codec)->Decode(pointers, erased, length));
        for (int unit : erased) {
          ASSERT_EQ(units[unit], expected[unit]) << "stripe " << stripe << " unit " << unit;
          if (unit >= k) continue;
          const int position = members.data_positions[unit];
          const uint64_t index = layout->DataUnitOf(position, stripe);
          const uint64_t unit_length = layout->UnitLength(data[position].size(), index);
          if (unit_length == 0) continue;  // past the end of a short node's data: nothing to put back
          std::copy_n(units[unit].begin(), unit_length,
                      rebuilt[position].begin() + index * kUnit);
        }
      }
      for (int position : lost) {
        ASSERT_EQ(rebuilt[position], data[position]) << "node " << position << " of pair "
                                                     << first << "," << second;
      }
    }
  }
}

}  // namespace
}  // namespace moesnap::erasure
