// ReedSolomon: exhaustive erasure patterns, reference parity checked into the tree, incremental
// parity updates, concurrency, and every rejected input.
#include "erasure/reed_solomon.h"

#include <gtest/gtest.h>

#include <bit>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/testing/deterministic_bytes.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::erasure {
namespace {

using moesnap::testing::DeterministicBytes;

// k + m units of one length, with pointer views in the shapes the codec takes.
struct Stripe {
  Stripe(int k, int m, size_t length) : data_units(k), units(k + m, std::vector<uint8_t>(length)) {}

  std::vector<const uint8_t*> Data() const {
    std::vector<const uint8_t*> out;
    for (int i = 0; i < data_units; ++i) out.push_back(units[i].data());
    return out;
  }
  std::vector<uint8_t*> Parity() {
    std::vector<uint8_t*> out;
    for (size_t i = data_units; i < units.size(); ++i) out.push_back(units[i].data());
    return out;
  }
  std::vector<uint8_t*> All() {
    std::vector<uint8_t*> out;
    for (auto& unit : units) out.push_back(unit.data());
    return out;
  }

  int data_units;
  std::vector<std::vector<uint8_t>> units;
};

Stripe EncodedStripe(const ReedSolomon& codec, size_t length, uint64_t seed) {
  Stripe stripe(codec.data_units(), codec.parity_units(), length);
  DeterministicBytes random(seed);
  for (int i = 0; i < codec.data_units(); ++i) random.Fill(stripe.units[i].data(), length);
  EXPECT_OK(codec.Encode(stripe.Data(), stripe.Parity(), length));
  return stripe;
}

std::string ToHex(const std::vector<uint8_t>& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  for (size_t i = 0; i < bytes.size(); ++i) {
    hex += kDigits[bytes[i] >> 4];
    hex += kDigits[bytes[i] & 15];
    if (i % 32 == 31) hex += '\n';
  }
  return hex;
}

struct Shape {
  int k;
  int m;
};

std::string ShapeName(const ::testing::TestParamInfo<Shape>& param_info) {
  return absl::StrCat("k", param_info.param.k, "m", param_info.param.m);
}

class ExhaustiveErasureTest : public ::testing::TestWithParam<Shape> {};

// Every pattern of 1..m lost units (data, parity or both), on lengths that are and are not multiples
// of the SIMD width, must give back every byte.
TEST_P(ExhaustiveErasureTest, EveryPatternOfUpToMErasuresDecodesExactly) {
  const auto [k, m] = GetParam();
  const int n = k + m;
  absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(k, m);
  ASSERT_OK(codec);
  for (size_t length : {size_t{1}, size_t{63}, size_t{64}, size_t{1000}, size_t{4097}}) {
    const Stripe original = EncodedStripe(**codec, length, 1000 * k + m + length);
    int patterns = 0;
    for (uint32_t mask = 1; mask < (1u << n); ++mask) {
      if (std::popcount(mask) > m) continue;
      std::vector<int> erased;
      for (int unit = 0; unit < n; ++unit) {
        if (mask & (1u << unit)) erased.push_back(unit);
      }
      Stripe damaged = original;
      for (int unit : erased) std::fill(damaged.units[unit].begin(), damaged.units[unit].end(), 0xA5);
      ASSERT_OK((*codec)->Decode(damaged.All(), erased, length));
      for (int unit : erased) {
        ASSERT_EQ(damaged.units[unit], original.units[unit])
            << "unit " << unit << " of mask " << mask << " at length " << length;
      }
      ++patterns;
    }
    // Sanity of the enumeration itself: sum of C(n, i) for i = 1..m.
    int expected = 0;
    for (int i = 1, c = 1; i <= m; ++i) {
      c = c * (n - i + 1) / i;
      expected += c;
    }
    EXPECT_EQ(patterns, expected);
  }
}

// Every choice of k sources and, for each, every unit outside them alone and all of them at once:
// the wanted units come back exactly, and the buffers neither read nor wanted stay null (a decode
// that touched one would crash).
class ExhaustiveSourcesTest : public ::testing::TestWithParam<Shape> {};

TEST_P(ExhaustiveSourcesTest, EveryChoiceOfSourcesDecodesOnlyTheWantedUnits) {
  const auto [k, m] = GetParam();
  const int n = k + m;
  absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(k, m);
  ASSERT_OK(codec);
  for (size_t length : {size_t{1}, size_t{100}, size_t{4097}}) {
    const Stripe original = EncodedStripe(**codec, length, 7000 * k + m + length);
    int choices = 0;
    for (uint32_t mask = 0; mask < (1u << n); ++mask) {
      if (std::popcount(mask) != k) continue;
      std::vector<int> sources, others;
      for (int unit = 0; unit < n; ++unit) (mask & (1u << unit) ? sources : others).push_back(unit);
      std::vector<std::vector<int>> wanted_sets = {others};
      for (int unit : others) wanted_sets.push_back({unit});
      for (const std::vector<int>& wanted : wanted_sets) {
        Stripe decoded = original;
        std::vector<uint8_t*> units(n, nullptr);
        for (int unit : sources) units[unit] = decoded.units[unit].data();
        for (int unit : wanted) {
          std::fill(decoded.units[unit].begin(), decoded.units[unit].end(), 0xA5);
          units[unit] = decoded.units[unit].data();
        }
        ASSERT_OK((*codec)->DecodeFrom(units, sources, wanted, length));
        EXPECT_EQ(decoded.units, original.units)
            << "sources mask " << mask << ", " << wanted.size() << " wanted, length " << length;
      }
      ++choices;
    }
    int expected = 1;  // C(n, k)
    for (int i = 1; i <= k; ++i) expected = expected * (n - k + i) / i;
    EXPECT_EQ(choices, expected);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ExhaustiveErasureTest,
                         ::testing::Values(Shape{2, 1}, Shape{4, 2}, Shape{6, 3}, Shape{8, 3},
                                           Shape{10, 4}, Shape{12, 4}),
                         ShapeName);

// C(k + m, k) choices of sources each: the shapes stay small enough to try them all.
INSTANTIATE_TEST_SUITE_P(Shapes, ExhaustiveSourcesTest,
                         ::testing::Values(Shape{2, 1}, Shape{4, 2}, Shape{6, 3}, Shape{8, 3}),
                         ShapeName);

// The parity of a fixed input is pinned by files in the tree: a change of matrix, table layout or
// ISA-L behaviour changes stored and transmitted parity, and must fail here first.
// Set MOESNAP_WRITE_REFERENCE=1 to rewrite the files after a deliberate format change.
class ReferenceParityTest : public ::testing::TestWithParam<Shape> {};

TEST_P(ReferenceParityTest, ParityMatchesCheckedInBytes) {
  const auto [k, m] = GetParam();
  constexpr size_t kLength = 256;
  absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(k, m);
  ASSERT_OK(codec);
  Stripe stripe = EncodedStripe(**codec, kLength, /*seed=*/0x6d6f65736e6170ULL);
  std::vector<uint8_t> parity;
  for (int i = k; i < k + m; ++i) {
    parity.insert(parity.end(), stripe.units[i].begin(), stripe.units[i].end());
  }
  const std::string path =
      absl::StrCat(MOESNAP_SOURCE_DIR, "/tests/erasure/reference_parity_k", k, "_m", m, ".hex");
  if (std::getenv("MOESNAP_WRITE_REFERENCE") != nullptr) {
    std::ofstream(path) << ToHex(parity);
  }
  std::ifstream file(path);
  ASSERT_TRUE(file.good()) << "missing reference file " << path;
  std::stringstream expected;
  expected << file.rdbuf();
  EXPECT_EQ(ToHex(parity), expected.str()) << "parity of the reference input changed: " << path;
}

INSTANTIATE_TEST_SUITE_P(Shapes, ReferenceParityTest,
                         ::testing::Values(Shape{4, 2}, Shape{10, 4}),
                         ShapeName);

// Random sequences of partial and whole-unit updates, in both the delta and the old/new form, keep
// parity equal to a full re-encode of the current data.
TEST(ReedSolomonUpdateTest, IncrementalUpdatesMatchFullReencode) {
  for (Shape shape : {Shape{4, 2}, Shape{10, 4}, Shape{12, 4}}) {
    absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(shape.k, shape.m);
    ASSERT_OK(codec);
    constexpr size_t kLength = 100 * 1024 + 17;  // more than one internal piece, odd tail
    Stripe stripe = EncodedStripe(**codec, kLength, 7);
    DeterministicBytes random(shape.k * 31 + shape.m);
    for (int update = 0; update < 40; ++update) {
      const int index = static_cast<int>(random.Next() % shape.k);
      const size_t offset = random.Next() % kLength;
      const size_t length = 1 + random.Next() % (kLength - offset);
      std::vector<uint8_t>& unit = stripe.units[index];
      std::vector<uint8_t> old_bytes(unit.begin() + offset, unit.begin() + offset + length);
      random.Fill(unit.data() + offset, length);

      std::vector<uint8_t*> parity_at_offset;
      for (uint8_t* parity : stripe.Parity()) parity_at_offset.push_back(parity + offset);
      if (update % 2 == 0) {
        ASSERT_OK((*codec)->UpdateParity(index, old_bytes.data(), unit.data() + offset,
                                         parity_at_offset, length));
      } else {
        std::vector<uint8_t> delta(length);
        for (size_t i = 0; i < length; ++i) delta[i] = old_bytes[i] ^ unit[offset + i];
        ASSERT_OK((*codec)->UpdateParity(index, delta.data(), parity_at_offset, length));
      }

      Stripe reencoded = stripe;
      ASSERT_OK((*codec)->Encode(reencoded.Data(), reencoded.Parity(), kLength));
      for (int i = shape.k; i < shape.k + shape.m; ++i) {
        ASSERT_EQ(stripe.units[i], reencoded.units[i])
            << "parity " << i << " after update " << update << " of (" << shape.k << ","
            << shape.m << ")";
      }
    }
  }
}

// A holder of one parity unit builds it from the k data units in any order, each as a delta from
// zero, and gets exactly the unit a full Encode computes; bad indices are refused.
TEST(ReedSolomonUpdateTest, OneParityUnitBuiltFromDataUnitsInAnyOrder) {
  for (Shape shape : {Shape{4, 2}, Shape{10, 4}}) {
    absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(shape.k, shape.m);
    ASSERT_OK(codec);
    constexpr size_t kLength = 4096 + 33;
    const Stripe stripe = EncodedStripe(**codec, kLength, 11);
    for (int j = 0; j < shape.m; ++j) {
      std::vector<uint8_t> parity(kLength, 0);
      for (int step = 0; step < shape.k; ++step) {
        const int i = j % 2 == 0 ? shape.k - 1 - step : step;  // backwards, then forwards
        ASSERT_OK((*codec)->UpdateParityUnit(i, j, stripe.units[i].data(), parity.data(), kLength));
      }
      EXPECT_EQ(parity, stripe.units[shape.k + j]) << "parity " << j << " of (" << shape.k << ","
                                                    << shape.m << ")";
    }
    std::vector<uint8_t> parity(kLength);
    EXPECT_STATUS((*codec)->UpdateParityUnit(shape.k, 0, stripe.units[0].data(), parity.data(), kLength),
                  absl::StatusCode::kInvalidArgument);
    EXPECT_STATUS((*codec)->UpdateParityUnit(0, shape.m, stripe.units[0].data(), parity.data(), kLength),
                  absl::StatusCode::kInvalidArgument);
  }
}

// The out-of-place update gives the bytes of a copy of the base updated in place, for every
// (data, parity) pair and lengths about ISA-L's 32- and 64-byte loops; without a base, those of a
// unit at zero updated. Bad indices and a parity buffer over an input are refused.
TEST(ReedSolomonUpdateTest, AnUpdateOutOfPlaceEqualsACopyUpdatedInPlace) {
  for (Shape shape : {Shape{2, 1}, Shape{4, 2}, Shape{10, 4}}) {
    absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(shape.k, shape.m);
    ASSERT_OK(codec);
    for (size_t length : {size_t{1}, size_t{31}, size_t{64}, size_t{65}, size_t{4096 + 33}}) {
      DeterministicBytes random(length);
      std::vector<uint8_t> base(length), delta(length);
      random.Fill(base.data(), length);
      random.Fill(delta.data(), length);
      for (int i = 0; i < shape.k; ++i) {
        for (int j = 0; j < shape.m; ++j) {
          std::vector<uint8_t> expected = base;
          ASSERT_OK((*codec)->UpdateParityUnit(i, j, delta.data(), expected.data(), length));
          std::vector<uint8_t> parity(length, 0xee);
          ASSERT_OK((*codec)->UpdatedParityUnit(i, j, base.data(), delta.data(), parity.data(),
                                                length));
          EXPECT_EQ(parity, expected) << "(" << i << ", " << j << ") of (" << shape.k << ","
                                      << shape.m << "), " << length << " bytes";
          std::vector<uint8_t> from_zero(length, 0);
          ASSERT_OK((*codec)->UpdateParityUnit(i, j, delta.data(), from_zero.data(), length));
          std::fill(parity.begin(), parity.end(), 0xee);
          ASSERT_OK((*codec)->UpdatedParityUnit(i, j, nullptr, delta.data(), parity.data(),
                                                length));
          EXPECT_EQ(parity, from_zero) << "(" << i << ", " << j << ") from zero, " << length
                                       << " bytes";
        }
      }
    }
    std::vector<uint8_t> base(128, 1), delta(128, 2), parity(128);
    EXPECT_STATUS((*codec)->UpdatedParityUnit(shape.k, 0, base.data(), delta.data(),
                                              parity.data(), 128),
                  absl::StatusCode::kInvalidArgument);
    EXPECT_STATUS((*codec)->UpdatedParityUnit(0, shape.m, nullptr, delta.data(), parity.data(),
                                              128),
                  absl::StatusCode::kInvalidArgument);
    EXPECT_STATUS((*codec)->UpdatedParityUnit(0, 0, base.data(), delta.data(), base.data() + 32,
                                              64),
                  absl::StatusCode::kInvalidArgument);
    EXPECT_STATUS((*codec)->UpdatedParityUnit(0, 0, base.data(), delta.data(), delta.data(), 128),
                  absl::StatusCode::kInvalidArgument);
  }
}

TEST(ReedSolomonTest, LargestShapesRoundTrip) {
  for (Shape shape : {Shape{1, 255}, Shape{255, 1}, Shape{200, 56}}) {
    absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(shape.k, shape.m);
    ASSERT_OK(codec);
    const Stripe original = EncodedStripe(**codec, 192, shape.k);
    // Lose the first m units (data first: the hardest inversion), then the last m.
    for (bool from_front : {true, false}) {
      std::vector<int> erased;
      for (int i = 0; i < shape.m; ++i) {
        erased.push_back(from_front ? i : shape.k + shape.m - 1 - i);
      }
      Stripe damaged = original;
      for (int unit : erased) damaged.units[unit].assign(192, 0);
      ASSERT_OK((*codec)->Decode(damaged.All(), erased, 192));
      EXPECT_EQ(damaged.units, original.units) << shape.k << "," << shape.m;
    }
  }
}

TEST(ReedSolomonTest, DecodeCacheIsBoundedAndStillCorrectAfterEviction) {
  absl::StatusOr<std::unique_ptr<ReedSolomon>> codec =
      ReedSolomon::Create(6, 3, /*decode_cache_entries=*/4);
  ASSERT_OK(codec);
  const Stripe original = EncodedStripe(**codec, 512, 3);
  for (int round = 0; round < 2; ++round) {
    for (int first = 0; first < 9; ++first) {
      std::vector<int> erased = {first, (first + 4) % 9};
      Stripe damaged = original;
      for (int unit : erased) damaged.units[unit].assign(512, 0);
      ASSERT_OK((*codec)->Decode(damaged.All(), erased, 512));
      ASSERT_EQ(damaged.units, original.units);
      EXPECT_LE((*codec)->cached_decode_patterns(), 4u);
    }
  }
  EXPECT_EQ((*codec)->cached_decode_patterns(), 4u);
}

TEST(ReedSolomonTest, ConcurrentEncodesAndDecodesAgree) {
  absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(8, 3, 8);
  ASSERT_OK(codec);
  const ReedSolomon& shared = **codec;
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 50; ++round) {
        const Stripe original = EncodedStripe(shared, 4096, t * 1000 + round);
        std::vector<int> erased = {(t + round) % 11, (t + round + 3) % 11, (t + round + 7) % 11};
        Stripe damaged = original;
        for (int unit : erased) damaged.units[unit].assign(4096, 0);
        if (!shared.Decode(damaged.All(), erased, 4096).ok() || damaged.units != original.units) {
          ++failures[t];
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures, std::vector<int>(4, 0));
}

TEST(ReedSolomonErrorTest, RejectsUnsupportedShapesNamingThem) {
  for (Shape shape : {Shape{0, 1}, Shape{1, 0}, Shape{-1, 2}, Shape{200, 57}, Shape{256, 1}}) {
    absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(shape.k, shape.m);
    ASSERT_STATUS(codec, absl::StatusCode::kInvalidArgument);
    EXPECT_NE(codec.status().message().find(absl::StrCat("k=", shape.k, ", m=", shape.m)),
              std::string::npos)
        << codec.status();
  }
}

TEST(ReedSolomonErrorTest, MoreThanMErasuresIsRejectedAndTouchesNothing) {
  absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(4, 2);
  ASSERT_OK(codec);
  const Stripe original = EncodedStripe(**codec, 128, 11);
  Stripe damaged = original;
  const std::vector<int> erased = {0, 1, 5};
  absl::Status status = (*codec)->Decode(damaged.All(), erased, 128);
  ASSERT_STATUS(status, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("recovers at most 2"), std::string::npos) << status;
  EXPECT_EQ(damaged.units, original.units);
}

TEST(ReedSolomonErrorTest, RejectsBadBuffersLengthsAndIndices) {
  absl::StatusOr<std::unique_ptr<ReedSolomon>> codec = ReedSolomon::Create(4, 2);
  ASSERT_OK(codec);
  const ReedSolomon& rs = **codec;
  Stripe stripe = EncodedStripe(rs, 256, 5);
  const Stripe before = stripe;
  std::vector<const uint8_t*> data = stripe.Data();
  std::vector<uint8_t*> parity = stripe.Parity();
  std::vector<uint8_t*> all = stripe.All();
  const std::vector<int> one_lost = {1};

  // Counts and nulls.
  EXPECT_STATUS(rs.Encode(absl::MakeSpan(data).subspan(1), parity, 256),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.Encode(data, absl::MakeSpan(parity).subspan(1), 256),
                absl::StatusCode::kInvalidArgument);
  std::vector<const uint8_t*> with_null = data;
  with_null[2] = nullptr;
  absl::Status null_status = rs.Encode(with_null, parity, 256);
  EXPECT_STATUS(null_status, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(null_status.message().find("data buffer 2 is null"), std::string::npos);
  EXPECT_STATUS(rs.Decode(absl::MakeSpan(all).subspan(1), one_lost, 256),
                absl::StatusCode::kInvalidArgument);

  // Lengths.
  EXPECT_STATUS(rs.Encode(data, parity, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.Decode(all, one_lost, size_t{1} << 31), absl::StatusCode::kInvalidArgument);

  // Aliasing: parity onto data, parity onto parity, a decode output onto a survivor.
  std::vector<uint8_t*> parity_on_data = {stripe.units[0].data() + 8, parity[1]};
  EXPECT_STATUS(rs.Encode(data, parity_on_data, 256), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t*> parity_twice = {parity[0], parity[0]};
  EXPECT_STATUS(rs.Encode(data, parity_twice, 256), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t*> aliased_units = all;
  aliased_units[1] = all[2];
  EXPECT_STATUS(rs.Decode(aliased_units, one_lost, 256), absl::StatusCode::kInvalidArgument);
  // Unit 5 is not among the k survivors read, yet Decode never writes over a survivor.
  std::vector<uint8_t*> onto_unread_survivor = all;
  onto_unread_survivor[1] = all[5];
  EXPECT_STATUS(rs.Decode(onto_unread_survivor, one_lost, 256),
                absl::StatusCode::kInvalidArgument);

  // Erased indices.
  EXPECT_STATUS(rs.Decode(all, std::vector<int>{6}, 256), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.Decode(all, std::vector<int>{-1}, 256), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.Decode(all, std::vector<int>{3, 3}, 256), absl::StatusCode::kInvalidArgument);

  // DecodeFrom: k distinct sources, wanted units apart from them, listed buffers not null and
  // disjoint; nothing is written when any of that fails.
  const std::vector<int> sources = {0, 2, 3, 4};
  const std::vector<int> unit_one = {1};
  EXPECT_STATUS(rs.DecodeFrom(all, std::vector<int>{0, 2, 3}, unit_one, 256),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.DecodeFrom(all, std::vector<int>{0, 2, 2, 4}, unit_one, 256),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.DecodeFrom(all, sources, std::vector<int>{4}, 256),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.DecodeFrom(all, sources, std::vector<int>{6}, 256),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.DecodeFrom(all, std::vector<int>{0, 2, 3, -1}, unit_one, 256),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.DecodeFrom(absl::MakeSpan(all).subspan(1), sources, unit_one, 256),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.DecodeFrom(all, sources, unit_one, 0), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t*> null_source = all;
  null_source[3] = nullptr;
  absl::Status null_source_status = rs.DecodeFrom(null_source, sources, unit_one, 256);
  EXPECT_STATUS(null_source_status, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(null_source_status.message().find("unit buffer 3 is null"), std::string::npos);
  std::vector<uint8_t*> wanted_on_source = all;
  wanted_on_source[1] = all[2] + 8;
  EXPECT_STATUS(rs.DecodeFrom(wanted_on_source, sources, unit_one, 256),
                absl::StatusCode::kInvalidArgument);
  const std::vector<int> two_wanted = {1, 5};
  std::vector<uint8_t*> null_wanted = all;
  null_wanted[5] = nullptr;
  EXPECT_STATUS(rs.DecodeFrom(null_wanted, sources, two_wanted, 256),
                absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t*> wanted_on_wanted = all;
  wanted_on_wanted[5] = all[1] + 8;
  EXPECT_STATUS(rs.DecodeFrom(wanted_on_wanted, sources, two_wanted, 256),
                absl::StatusCode::kInvalidArgument);

  // Updates.
  std::vector<uint8_t> delta(256, 1);
  EXPECT_STATUS(rs.UpdateParity(4, delta.data(), parity, 256), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.UpdateParity(0, nullptr, parity, 256), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.UpdateParity(0, parity[0], parity, 256), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(rs.UpdateParity(7, delta.data(), delta.data(), parity, 256),
                absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(stripe.units, before.units) << "a rejected call wrote into a buffer";
}

}  // namespace
}  // namespace moesnap::erasure
