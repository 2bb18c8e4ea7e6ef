// NodeImage: reads and writes across region boundaries, layout comparison, and which stripe units a
// sparse step changed.
#include "daemon/node_image.h"

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_pool.h"

namespace moesnap::daemon {
namespace {

v1::NodeImage Manifest(const std::vector<std::pair<std::string, uint64_t>>& regions,
                       const std::vector<int64_t>& steps) {
  v1::NodeImage manifest;
  for (size_t i = 0; i < regions.size(); ++i) {
    v1::ImageRegion* region = manifest.add_regions();
    region->set_rank(0);
    region->set_region(regions[i].first);
    region->set_bytes(regions[i].second);
    region->set_step(steps[i]);
    region->set_chunk_bytes(4096);
  }
  return manifest;
}

TEST(NodeImageTest, ReadsAndWritesSpanRegionsAndReadZerosPastTheEnd) {
  const testing::TestPool pool(1 << 20);
  absl::StatusOr<NodeImage> image =
      NodeImage::Allocate(pool.get(), Manifest({{"a", 100}, {"b", 7}, {"c", 5000}}, {1, 1, 1}));
  ASSERT_OK(image);
  EXPECT_EQ(image->bytes(), 5107u);
  std::vector<uint8_t> bytes(5107);
  std::iota(bytes.begin(), bytes.end(), 0);
  image->Write(0, bytes.data(), 50);
  image->Write(50, bytes.data() + 50, bytes.size() - 50);  // crosses all three regions
  std::vector<uint8_t> read(6000, 0xff);
  image->Read(0, read.size(), read.data());
  EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), read.begin()));
  EXPECT_TRUE(std::all_of(read.begin() + 5107, read.end(), [](uint8_t b) { return b == 0; }));
  EXPECT_EQ(image->stored()[1]->pieces()[0].data[0], bytes[100]);  // region b starts at image offset 100
  // A read from inside the image past its end: the bytes past the end read as zero.
  std::vector<uint8_t> tail(200, 0xff);
  image->Read(5000, tail.size(), tail.data());
  EXPECT_TRUE(std::equal(bytes.begin() + 5000, bytes.end(), tail.begin()));
  EXPECT_TRUE(std::all_of(tail.begin() + 107, tail.end(), [](uint8_t b) { return b == 0; }));
}

// A region's bytes held in extents of the given sizes, one after another.
std::shared_ptr<PoolBytes> HeldIn(const testing::TestPool& pool,
                                  const std::vector<uint64_t>& extent_bytes) {
  PoolBytes::Extents extents;
  uint64_t bytes = 0;
  for (uint64_t each : extent_bytes) {
    absl::StatusOr<std::shared_ptr<PoolExtent>> extent = pool.get()->Allocate(each);
    EXPECT_OK(extent);
    extents.push_back(*std::move(extent));
    bytes += each;
  }
  return std::make_shared<PoolBytes>(std::move(extents), bytes);
}

// A unit's delta against the committed step: this image's bytes XOR those of the same regions at
// another step, each side held in pieces that do not line up with the other's.
TEST(NodeImageTest, XorWithTheLayoutsBytesAtAnotherStepIsTheDeltaOfAnyRange) {
  const testing::TestPool pool(1 << 20);
  const NodeImage image(Manifest({{"a", 100}, {"b", 7}, {"c", 5000}}, {2, 2, 2}),
                        {HeldIn(pool, {100}), HeldIn(pool, {7}), HeldIn(pool, {2500, 2500})});
  const std::vector<std::shared_ptr<PoolBytes>> other = {
      HeldIn(pool, {60, 40}), HeldIn(pool, {7}), HeldIn(pool, {1000, 3000, 1000})};
  ASSERT_EQ(image.stored()[2]->pieces().size(), 2u);
  ASSERT_EQ(other[2]->pieces().size(), 3u);
  std::vector<uint8_t> mine(image.bytes());
  std::iota(mine.begin(), mine.end(), 0);
  image.Write(0, mine.data(), mine.size());
  std::vector<uint8_t> theirs(mine.size());
  for (size_t i = 0; i < theirs.size(); ++i) theirs[i] = static_cast<uint8_t>(i * 13 + 5);
  other[0]->Write(0, theirs.data(), 100);
  other[1]->Write(0, theirs.data() + 100, 7);
  other[2]->Write(0, theirs.data() + 107, 5000);
  for (auto [offset, length] : {std::pair<uint64_t, uint64_t>{0, 5107}, {50, 60}, {90, 20},
                                {1100, 3010}, {2990, 30}, {5100, 7}}) {
    std::vector<uint8_t> expected(length), delta(length, 0xee);
    for (uint64_t i = 0; i < length; ++i) expected[i] = mine[offset + i] ^ theirs[offset + i];
    image.XorWith(other, offset, length, delta.data());
    EXPECT_EQ(delta, expected) << "[" << offset << ", +" << length << ")";
  }
}

TEST(NodeImageTest, SpansAreThePoolBytesOfARangeInOrderWithAdjacentOnesMerged) {
  const testing::TestPool pool(1 << 20);
  // a, b and c lie one after another in a fresh pool; c's 100 bytes take 128 of it, so d does not
  // follow its last byte.
  absl::StatusOr<NodeImage> image = NodeImage::Allocate(
      pool.get(), Manifest({{"a", 128}, {"b", 64}, {"c", 100}, {"d", 50}}, {1, 1, 1, 1}));
  ASSERT_OK(image);
  const uint8_t* a = image->stored()[0]->pieces()[0].data;
  const uint8_t* d = image->stored()[3]->pieces()[0].data;
  ASSERT_EQ(image->stored()[1]->pieces()[0].data, a + 128);
  ASSERT_EQ(image->stored()[2]->pieces()[0].data, a + 192);
  ASSERT_NE(d, a + 292);
  std::vector<uint8_t> bytes(image->bytes());
  std::iota(bytes.begin(), bytes.end(), 0);
  image->Write(0, bytes.data(), bytes.size());

  std::vector<absl::Span<const uint8_t>> spans = image->Spans(0, image->bytes());
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].data(), a);
  EXPECT_EQ(spans[0].size(), 292u);
  EXPECT_EQ(spans[1].data(), d);
  EXPECT_EQ(spans[1].size(), 50u);
  spans = image->Spans(150, 160);  // from inside b, across c, into d
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].data(), a + 150);
  EXPECT_EQ(spans[0].size(), 142u);
  EXPECT_EQ(spans[1].data(), d);
  EXPECT_EQ(spans[1].size(), 18u);
  std::vector<uint8_t> gathered;
  for (absl::Span<const uint8_t> span : spans) {
    gathered.insert(gathered.end(), span.begin(), span.end());
  }
  EXPECT_TRUE(std::equal(gathered.begin(), gathered.end(), bytes.begin() + 150));
}

// An image built in place maps its regions as one given its manifest, and a copy is whole and
// independent: its manifest lives on an arena of its own, so it outlives the original (and an
// image assigned over drops its old manifest with its old arena).
TEST(NodeImageTest, AnImageBuiltInPlaceAndItsCopiesHoldTheirManifestsWhole) {
  const testing::TestPool pool(1 << 20);
  absl::StatusOr<NodeImage> allocated =
      NodeImage::Allocate(pool.get(), Manifest({{"layer0.weight", 100}, {"b", 7}}, {3, 4}));
  ASSERT_OK(allocated);
  std::vector<uint8_t> bytes(107);
  std::iota(bytes.begin(), bytes.end(), 0);
  allocated->Write(0, bytes.data(), bytes.size());

  auto built = std::make_unique<NodeImage>(NodeImage::Built(
      [&](v1::NodeImage& manifest, std::vector<std::shared_ptr<PoolBytes>>& stored) {
        manifest.set_step(4);
        for (int i = 0; i < allocated->manifest().regions_size(); ++i) {
          *manifest.add_regions() = allocated->manifest().regions(i);
          stored.push_back(allocated->stored()[i]);
        }
      }));
  EXPECT_EQ(built->bytes(), 107u);  // set from the regions
  EXPECT_EQ(built->manifest().step(), 4);
  EXPECT_EQ(built->ChunkRange(1, 0), (std::pair<uint64_t, uint64_t>{100, 7}));  // offset, length

  NodeImage copy = *built;
  NodeImage assigned = NodeImage::Built([](v1::NodeImage& manifest, auto&) {
    manifest.add_regions()->set_region("replaced");
  });
  assigned = copy;
  NodeImage moved = std::move(*built);
  built.reset();
  for (const NodeImage* image : {&copy, &assigned, &moved}) {
    ASSERT_EQ(image->manifest().regions_size(), 2);
    EXPECT_EQ(image->manifest().regions(0).region(), "layer0.weight");
    EXPECT_EQ(image->manifest().regions(1).step(), 4);
    EXPECT_EQ(image->bytes(), 107u);
    std::vector<uint8_t> read(107);
    image->Read(0, read.size(), read.data());
    EXPECT_EQ(read, bytes);
  }
}

// An image built in recycled memory writes only the entries whose keys the memory does not hold
// at their positions, drops the entries past its last, and hands its memory back as it goes (a
// copy's and a moved-from image's memory does not go back); the recycler keeps two memories.
TEST(NodeImageTest, AnImageBuiltInRecycledMemoryWritesTheEntriesWhoseKeysChanged) {
  const testing::TestPool pool(1 << 20);
  absl::StatusOr<NodeImage> allocated = NodeImage::Allocate(
      pool.get(),
      Manifest({{"a", 10}, {"b", 20}, {"c", 30}, {"d", 40}, {"e", 50}}, {1, 1, 1, 1, 1}));
  ASSERT_OK(allocated);
  std::vector<uint8_t> bytes(150);
  std::iota(bytes.begin(), bytes.end(), 0);
  allocated->Write(0, bytes.data(), bytes.size());
  auto recycler = std::make_shared<ManifestRecycler>();
  // Builds an image of regions (key, name, step), counting the entries it writes.
  int written = 0;
  auto build = [&](const std::vector<std::tuple<uint64_t, std::string, int64_t>>& regions) {
    return NodeImage::BuiltIn(recycler, [&](NodeImage::Entries& entries) {
      entries.manifest().set_step(9);
      for (size_t i = 0; i < regions.size(); ++i) {
        const size_t held = i % allocated->stored().size();  // region i's bytes
        entries.Add(std::get<0>(regions[i]), allocated->stored()[held], [&](v1::ImageRegion& entry) {
          EXPECT_EQ(entry.ByteSizeLong(), 0u) << "an entry is written cleared";
          entry.set_region(std::get<1>(regions[i]));
          entry.set_step(std::get<2>(regions[i]));
          entry.set_bytes(allocated->manifest().regions(static_cast<int>(held)).bytes());
          ++written;
        });
      }
    });
  };
  auto regions_of = [](const NodeImage& image) {
    std::vector<std::pair<std::string, int64_t>> regions;
    for (const v1::ImageRegion& entry : image.manifest().regions()) {
      regions.emplace_back(entry.region(), entry.step());
    }
    return regions;
  };
  using Regions = std::vector<std::pair<std::string, int64_t>>;

  std::optional<NodeImage> first = build({{1, "a", 1}, {2, "b", 1}, {3, "c", 1}, {4, "d", 1}});
  EXPECT_EQ(written, 4);
  first->set_node_id(5);
  first.reset();  // its memory goes back
  written = 0;
  NodeImage second = build({{1, "a", 1}, {2, "b", 1}, {7, "c", 2}, {4, "d", 1}, {8, "e", 2}});
  EXPECT_EQ(written, 2) << "the changed entry and the added one";
  EXPECT_EQ(regions_of(second), (Regions{{"a", 1}, {"b", 1}, {"c", 2}, {"d", 1}, {"e", 2}}));
  EXPECT_EQ(second.manifest().node_id(), 0u) << "the fields on top start cleared";
  EXPECT_EQ(second.manifest().step(), 9);
  EXPECT_EQ(second.bytes(), 150u);
  std::vector<uint8_t> read(150);
  second.Read(0, read.size(), read.data());
  EXPECT_EQ(read, bytes) << "the regions' bytes are the ones added, in order";

  // A copy goes nowhere; the built image's memory goes back once, as it is moved and dropped.
  std::optional<NodeImage> copy = second;
  std::optional<NodeImage> moved = std::move(second);
  copy.reset();
  moved.reset();
  written = 0;
  NodeImage third = build({{1, "a", 1}, {9, "b", 3}});
  EXPECT_EQ(written, 1) << "the memory is the last image's: entries past the second dropped";
  EXPECT_EQ(regions_of(third), (Regions{{"a", 1}, {"b", 3}}));
  EXPECT_EQ(third.bytes(), 30u);
  // Taken from the recycler: the next build has none and writes every entry.
  written = 0;
  NodeImage fourth = build({{1, "a", 1}, {9, "b", 3}});
  EXPECT_EQ(written, 2);

  // Three images hold three memories; handed back together, the recycler keeps the last two
  // handed back, and gives the newest first.
  std::optional<NodeImage> fifth = build({{1, "a", 1}});  // new memory: the recycler holds none
  third = NodeImage();  // an image assigned another hands its memory back
  fourth = NodeImage();
  fifth.reset();
  written = 0;
  NodeImage sixth = build({{1, "a", 1}, {9, "b", 3}});
  EXPECT_EQ(written, 1) << "the newest memory holds entry a alone";
  written = 0;
  NodeImage seventh = build({{1, "a", 1}, {9, "b", 3}});
  EXPECT_EQ(written, 0) << "the next holds both";
  written = 0;
  NodeImage eighth = build({{1, "a", 1}, {9, "b", 3}});
  EXPECT_EQ(written, 2) << "and the oldest went";

  // A memory whose arena grew past twice what its first build took (and a block) is not kept.
  {
    const NodeImage small = build({{1, "a", 1}});  // new memory
  }
  {
    std::vector<std::tuple<uint64_t, std::string, int64_t>> many = {{1, "a", 1}};
    for (uint64_t i = 0; i < 4000; ++i) many.emplace_back(100 + i, absl::StrCat("r", i), 3);
    const NodeImage large = build(many);
  }
  written = 0;
  const NodeImage after_large = build({{1, "a", 1}});
  EXPECT_EQ(written, 1) << "built in new memory";
}

// A store rewrites its ranks' records on a recycled manifest's arena every step, each cleared and
// assigned anew: clearing one keeps every message it holds for the next to reuse, a rank's replica
// group among them, so the arena does not grow step by step.
TEST(NodeImageTest, RanksRecordsRewrittenOnAnArenaReuseItsMemory) {
  v1::JournalRank record;
  record.set_rank(3);
  record.set_latest_committed_step(9);
  v1::ReplicaGroupStep& layout = *record.add_replica_groups();
  layout.mutable_group()->set_name("model.layers.12.mlp.experts.replicated");
  layout.mutable_group()->add_ranks(3);
  layout.mutable_group()->add_ranks(4);
  layout.set_step(9);
  record.mutable_committed_window()->set_first_step(4);
  google::protobuf::Arena arena;
  auto* manifest = google::protobuf::Arena::CreateMessage<v1::NodeImage>(&arena);
  auto rewrite = [&] {
    manifest->clear_ranks();
    *manifest->add_ranks() = record;
  };
  rewrite();
  const uint64_t after_first = arena.SpaceAllocated();
  for (int step = 0; step < 10000; ++step) rewrite();
  EXPECT_EQ(arena.SpaceAllocated(), after_first);
  EXPECT_EQ(manifest->ranks(0).SerializeAsString(), record.SerializeAsString());
}

TEST(NodeImageTest, ChangedUnitsAreThoseHoldingARegionCapturedAgain) {
  const v1::NodeImage before = Manifest({{"a", 100}, {"b", 300}, {"c", 50}, {"d", 600}}, {1, 1, 1, 1});
  // b (bytes 100-399) and d (450-1049) were captured again at step 2; units are 256 bytes.
  const v1::NodeImage after = Manifest({{"a", 100}, {"b", 300}, {"c", 50}, {"d", 600}}, {1, 2, 1, 2});
  EXPECT_EQ(ChangedUnits(before, after, 256), (std::vector<bool>{true, true, true, true, true}));
  const v1::NodeImage only_a = Manifest({{"a", 100}, {"b", 300}, {"c", 50}, {"d", 600}}, {2, 1, 1, 1});
  EXPECT_EQ(ChangedUnits(before, only_a, 256), (std::vector<bool>{true, false, false, false, false}));
  const v1::NodeImage only_c = Manifest({{"a", 100}, {"b", 300}, {"c", 50}, {"d", 600}}, {1, 1, 2, 1});
  EXPECT_EQ(ChangedUnits(before, only_c, 256), (std::vector<bool>{false, true, false, false, false}));
  // Nothing changed: every unit is there, none changed (the last is partly past the image).
  EXPECT_EQ(ChangedUnits(before, before, 256), std::vector<bool>(5, false));
  EXPECT_EQ(ChangedUnits(before, before, 2000), std::vector<bool>(1, false));

  // Another layout: a region fewer, more bytes, another name or another rank.
  std::vector<v1::NodeImage> others = {
      Manifest({{"a", 100}, {"b", 300}, {"c", 50}}, {1, 1, 1}),
      Manifest({{"a", 100}, {"b", 301}, {"c", 50}, {"d", 600}}, {1, 1, 1, 1}),
      Manifest({{"a", 100}, {"x", 300}, {"c", 50}, {"d", 600}}, {1, 1, 1, 1}), before};
  others.back().mutable_regions(3)->set_rank(1);
  for (const v1::NodeImage& other : others) {
    EXPECT_FALSE(ChangedUnits(before, other, 256).has_value()) << other.ShortDebugString();
  }
}

// An image that is another but for some regions (a patched image) has its changed units found from
// those regions alone: the same units ChangedUnits finds walking both images whole, whichever
// regions changed (none, the first, the last, several in one unit, some only in a field that is not
// their step), and no units at all when one of them changed its layout.
TEST(NodeImageTest, ChangedUnitsAtTheChangedRegionsAreThoseOfTheWholeWalk) {
  std::vector<std::pair<std::string, uint64_t>> regions;
  for (int i = 0; i < 40; ++i) regions.emplace_back(absl::StrCat("r", i), 1 + (i * 37) % 300);
  regions[5].second = 0;  // an empty region, changed too
  v1::NodeImage before = Manifest(regions, std::vector<int64_t>(regions.size(), 1));
  uint64_t total = 0;
  for (const auto& [name, bytes] : regions) total += bytes;
  before.set_bytes(total);
  for (const std::vector<uint32_t>& positions :
       {std::vector<uint32_t>{}, {0}, {39}, {3, 4, 5, 6}, {1, 17, 18, 30, 39}, {2, 9}}) {
    v1::NodeImage after = before;
    for (uint32_t position : positions) {
      v1::ImageRegion& region = *after.mutable_regions(static_cast<int>(position));
      if (position == 9) {
        region.add_chunk_crcs(5);  // changed, but not captured again
      } else {
        region.set_step(2);
      }
    }
    for (uint64_t unit_bytes : {64, 256, 5000}) {
      const std::optional<std::vector<bool>> whole = ChangedUnits(before, after, unit_bytes);
      ASSERT_TRUE(whole.has_value());
      EXPECT_EQ(ChangedUnitsAt(before, after, positions, unit_bytes), whole)
          << positions.size() << " regions changed, units of " << unit_bytes;
    }
  }
  // A changed region of another layout, positions beyond the image, or an image whose bytes are
  // not its regions' sum: no units.
  v1::NodeImage resized = before;
  resized.mutable_regions(7)->set_bytes(regions[7].second + 1);
  resized.set_bytes(total + 1);
  EXPECT_FALSE(ChangedUnitsAt(before, resized, std::vector<uint32_t>{7}, 256).has_value());
  v1::NodeImage renamed = before;
  renamed.mutable_regions(7)->set_region("other");
  EXPECT_FALSE(ChangedUnitsAt(before, renamed, std::vector<uint32_t>{7}, 256).has_value());
  EXPECT_FALSE(ChangedUnitsAt(before, before, std::vector<uint32_t>{40}, 256).has_value());
  EXPECT_FALSE(ChangedUnitsAt(before, before, std::vector<uint32_t>{8, 3}, 256).has_value());
  v1::NodeImage short_bytes = before;
  short_bytes.set_bytes(total - 200);
  short_bytes.mutable_regions(39)->set_step(2);
  EXPECT_FALSE(ChangedUnitsAt(before, short_bytes, std::vector<uint32_t>{39}, 256).has_value());
}

}  // namespace
}  // namespace moesnap::daemon
