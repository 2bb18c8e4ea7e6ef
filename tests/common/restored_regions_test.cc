// The columns of a restore's regions: what is added reads back in order, and columns that
// disagree (a broken or hostile peer's answer) are refused before anything is read from them.
#include "proto/restored_regions.h"

#include <gtest/gtest.h>

#include <string>

#include "tests/testing/status_matchers.h"

namespace moesnap {
namespace {

v1::RestoredRegions ThreeRegions() {
  v1::RestoredRegions restored;
  v1::RegionPiece piece;
  piece.set_replica_group("data-parallel");
  piece.set_offset(4096);
  piece.set_region_bytes(8192);
  ReserveRestored(restored, 3);
  AddRestored(restored, "layer0.weight", 7, 4096);
  AddRestored(restored, "", 6, 0);
  AddRestored(restored, "experts.3.w1", 7, 4096, &piece);
  return restored;
}

TEST(RestoredRegionsTest, RegionsReadBackInTheOrderAdded) {
  const v1::RestoredRegions restored = ThreeRegions();
  absl::StatusOr<std::vector<RestoredRegionView>> regions = ReadRestored(restored);
  ASSERT_OK(regions);
  ASSERT_EQ(regions->size(), 3u);
  EXPECT_EQ((*regions)[0].name, "layer0.weight");
  EXPECT_EQ((*regions)[0].step, 7);
  EXPECT_EQ((*regions)[0].bytes, 4096u);
  EXPECT_EQ((*regions)[0].piece, nullptr);
  EXPECT_EQ((*regions)[1].name, "");
  EXPECT_EQ((*regions)[1].step, 6);
  EXPECT_EQ((*regions)[2].name, "experts.3.w1");
  ASSERT_NE((*regions)[2].piece, nullptr);
  EXPECT_EQ((*regions)[2].piece->offset(), 4096u);
  EXPECT_EQ((*regions)[2].piece->region_bytes(), 8192u);
}

TEST(RestoredRegionsTest, NoRegionsIsAnEmptyList) {
  absl::StatusOr<std::vector<RestoredRegionView>> regions = ReadRestored(v1::RestoredRegions());
  ASSERT_OK(regions);
  EXPECT_TRUE(regions->empty());
}

TEST(RestoredRegionsTest, AnAnswerWithoutTheColumnsIsFromAnOlderDaemonNotARestoreOfNothing) {
  v1::RestoreResponse response;
  response.set_step(7);
  absl::StatusOr<std::vector<RestoredRegionView>> regions = ReadRestored(response);
  ASSERT_EQ(regions.status().code(), absl::StatusCode::kFailedPrecondition) << regions.status();
  EXPECT_NE(regions.status().message().find("older release"), absl::string_view::npos);

  ReserveRestored(*response.mutable_restored(), 0);  // set, though empty: a restore of nothing
  regions = ReadRestored(response);
  ASSERT_OK(regions);
  EXPECT_TRUE(regions->empty());
}

TEST(RestoredRegionsTest, ColumnsThatDisagreeAreRefused) {
  struct Case {
    std::string what;
    void (*damage)(v1::RestoredRegions&);
  };
  const Case cases[] = {
      {"a step short", [](v1::RestoredRegions& r) { r.mutable_steps()->RemoveLast(); }},
      {"a size short", [](v1::RestoredRegions& r) { r.mutable_bytes()->RemoveLast(); }},
      {"a name length too many", [](v1::RestoredRegions& r) { r.add_name_lengths(0); }},
      {"names cut short", [](v1::RestoredRegions& r) { r.mutable_names()->pop_back(); }},
      {"names longer than their lengths",
       [](v1::RestoredRegions& r) { r.mutable_names()->push_back('x'); }},
      {"a length past the names", [](v1::RestoredRegions& r) { r.set_name_lengths(0, 1u << 31); }},
      {"a length that wraps the offset",
       [](v1::RestoredRegions& r) { r.set_name_lengths(1, 0xffffffffu); }},
      {"a piece of no region", [](v1::RestoredRegions& r) { (*r.mutable_pieces())[3]; }},
  };
  for (const Case& c : cases) {
    v1::RestoredRegions restored = ThreeRegions();
    c.damage(restored);
    absl::StatusOr<std::vector<RestoredRegionView>> regions = ReadRestored(restored);
    EXPECT_EQ(regions.status().code(), absl::StatusCode::kDataLoss) << c.what << ": "
                                                                     << regions.status();
  }
}

}  // namespace
}  // namespace moesnap
