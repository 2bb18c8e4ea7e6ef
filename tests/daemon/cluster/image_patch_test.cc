// Image patches: what a coordinator sends of a member's image builds, on the receiver's record of
// the base step, exactly the image it holds; anything else is refused, never built wrong.
#include "daemon/cluster/image_patch.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "erasure/crc32c.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

// Node 2's image at `step` of `regions` regions of 4 KiB, region i captured at `steps[i]` (every
// region at `step` when `steps` is empty).
v1::NodeImage Image(int64_t step, int regions, const std::vector<int64_t>& steps = {}) {
  v1::NodeImage image;
  image.set_node_id(2);
  image.set_step(step);
  image.set_bytes(uint64_t{4096} * regions);
  for (int i = 0; i < regions; ++i) {
    v1::ImageRegion& region = *image.add_regions();
    region.set_rank(i / 100);
    region.set_region(absl::StrCat("layers.", i, ".adam.exp_avg"));
    region.set_step(steps.empty() ? step : steps[i]);
    region.set_bytes(4096);
    region.set_dtype("float32");
    region.add_shape(1024);
    region.set_chunk_bytes(4096);
    region.add_chunk_crcs(static_cast<uint32_t>(7 * i + region.step()));
  }
  v1::JournalRank& rank = *image.add_ranks();
  rank.set_rank(0);
  rank.set_latest_committed_step(step);
  return image;
}

// Adds a field this build does not know to `message`.
void AddUnknownField(google::protobuf::Message& message) {
  message.GetReflection()->MutableUnknownFields(&message)->AddVarint(99, 1);
}

// PatchOf with the base's bytes at hand, as a proposing node calls it; the image's bytes it makes
// are checked to be the image's.
std::optional<ImagePatchOf> Patch(const v1::NodeImage& base, const v1::NodeImage& image) {
  std::string bytes;
  std::optional<ImagePatchOf> of = PatchOf(base, ImageBytes(base), image, bytes);
  if (of) {
    EXPECT_EQ(bytes, ImageBytes(image));
    EXPECT_EQ(of->patch.image_crc(), erasure::Crc32c(bytes.data(), bytes.size()));
  } else {
    EXPECT_EQ(bytes, "");
  }
  return of;
}

// Bytes written into a string that held others are the image's alone.
TEST(ImagePatchTest, BytesInReusedMemoryAreTheImagesAlone) {
  std::string memory(200000, 'x');
  for (int regions : {0, 1, 100, 1000}) {
    const v1::NodeImage image = Image(6, regions);
    ImageBytesInto(image, memory);
    EXPECT_EQ(memory, ImageBytes(image)) << regions;
  }
}

// A proposing node makes its image's bytes with its patch, spliced from its record's bytes of the
// base: whatever bytes it is given of the base, serialized whole where a splice could not be
// exact, they are the image's and the patch's CRC is theirs.
TEST(ImagePatchTest, TheBytesAPatchComesWithAreTheImagesSplicedOrNot) {
  const v1::NodeImage base = Image(6, 50);
  std::vector<int64_t> steps(50, 6);
  steps[0] = steps[17] = steps[49] = 7;
  const v1::NodeImage next = Image(7, 50, steps);
  const std::string expected = ImageBytes(next);
  const uint32_t crc = erasure::Crc32c(expected.data(), expected.size());
  for (const std::string& base_bytes : {ImageBytes(base), std::string(), std::string("junk")}) {
    std::string bytes = "left over";
    const std::optional<ImagePatchOf> of = PatchOf(base, base_bytes, next, bytes);
    ASSERT_TRUE(of.has_value());
    EXPECT_EQ(bytes, expected) << base_bytes.size() << " bytes of the base";
    EXPECT_EQ(of->patch.image_crc(), crc);
  }
  // An entry of the base carrying a field this build does not know compares equal to the image's
  // (SameEntry reads known fields), but its bytes are not the image's: nothing is spliced.
  for (bool in_piece : {false, true}) {
    v1::NodeImage unknown = base;
    v1::ImageRegion& region = *unknown.mutable_regions(20);
    google::protobuf::Message& carrier =
        in_piece ? static_cast<google::protobuf::Message&>(*region.mutable_piece()) : region;
    AddUnknownField(carrier);
    v1::NodeImage image = next;
    if (in_piece) image.mutable_regions(20)->mutable_piece();
    std::string bytes;
    const std::optional<ImagePatchOf> of = PatchOf(unknown, ImageBytes(unknown), image, bytes);
    ASSERT_TRUE(of.has_value());
    EXPECT_EQ(of->patch.changed_size(), 3);
    EXPECT_EQ(bytes, ImageBytes(image)) << (in_piece ? "in a piece" : "in an entry");
  }
  // An image off the wire carrying such a field, at its top, in an entry it did not change or in
  // that entry's piece: serialized whole, for a splice of the base's entries would drop it.
  for (int where : {0, 1, 2}) {
    v1::NodeImage on = base;
    on.mutable_regions(20)->mutable_piece();  // present on both sides: the entry is unchanged
    v1::NodeImage image = next;
    image.mutable_regions(20)->mutable_piece();
    google::protobuf::Message& carrier =
        where == 0   ? static_cast<google::protobuf::Message&>(image)
        : where == 1 ? static_cast<google::protobuf::Message&>(*image.mutable_regions(20))
                     : *image.mutable_regions(20)->mutable_piece();
    AddUnknownField(carrier);
    std::string bytes;
    const std::optional<ImagePatchOf> of = PatchOf(on, ImageBytes(on), image, bytes);
    ASSERT_TRUE(of.has_value());
    EXPECT_EQ(of->patch.changed_size(), 3) << where;
    EXPECT_EQ(bytes, ImageBytes(image)) << where;
  }
  // Bytes of another base are spliced as given (only a splice makes them differ): the caller's
  // are its record's, and a receiver's CRC check refuses anything else.
  v1::NodeImage other = base;
  other.mutable_regions(30)->set_chunk_crcs(0, 5);
  std::string bytes;
  ASSERT_TRUE(PatchOf(base, ImageBytes(other), next, bytes).has_value());
  EXPECT_NE(bytes, expected);
  // A dense step has no patch, and its bytes are the caller's to make: PatchOf leaves them.
  bytes = "the proposal's";
  ASSERT_FALSE(PatchOf(base, ImageBytes(base), Image(7, 50), bytes).has_value());
  EXPECT_EQ(bytes, "the proposal's");
}

TEST(ImagePatchTest, ASparseStepSendsItsChangedRegionsAndBuildsTheWholeImage) {
  const v1::NodeImage base = Image(6, 1000);
  std::vector<int64_t> steps(1000, 6);
  steps[3] = steps[999] = 7;
  const v1::NodeImage next = Image(7, 1000, steps);
  const std::optional<ImagePatchOf> of = Patch(base, next);
  ASSERT_TRUE(of.has_value());
  EXPECT_EQ(std::vector<uint32_t>(of->patch.changed().begin(), of->patch.changed().end()),
            (std::vector<uint32_t>{3, 999}));
  EXPECT_EQ(of->changes.regions_size(), 2);
  EXPECT_EQ(of->changes.ranks(0).latest_committed_step(), 7);
  std::string bytes;
  absl::StatusOr<v1::NodeImage> built = PatchedImage(base, {}, of->changes, of->patch, bytes);
  ASSERT_OK(built.status());
  EXPECT_EQ(ImageBytes(*built), ImageBytes(next));
  EXPECT_EQ(bytes, ImageBytes(next));
  // An unchanged image is a patch of nothing.
  const std::optional<ImagePatchOf> same = Patch(next, next);
  ASSERT_TRUE(same.has_value());
  EXPECT_EQ(same->patch.changed_size(), 0);
}

TEST(ImagePatchTest, AnImageBuiltInAnotherImagesMemoryKeepsNothingOfIt) {
  const v1::NodeImage base = Image(6, 10);
  std::vector<int64_t> steps(10, 6);
  steps[4] = 7;
  const v1::NodeImage next = Image(7, 10, steps);
  const ImagePatchOf of = *Patch(base, next);
  v1::NodeImage memory = Image(3, 40);
  memory.set_node_id(9);
  memory.mutable_regions(2)->mutable_piece()->set_replica_group("g");
  std::string bytes = ImageBytes(memory);
  absl::StatusOr<v1::NodeImage> built =
      PatchedImage(base, {}, of.changes, of.patch, bytes, {.image = std::move(memory)});
  ASSERT_OK(built.status());
  EXPECT_EQ(ImageBytes(*built), ImageBytes(next));
  EXPECT_EQ(bytes, ImageBytes(next));
}

// An image copied into memory that held another keeps its entries where they equal the copy's,
// and nothing of the other image: not its fields this build does not know (on top, in an entry
// equal to the copy's, in its piece), not its entries past the copy's, and it has every entry of
// a longer copy, unknown fields included.
TEST(ImagePatchTest, AnImageCopiedIntoAnothersMemoryIsTheCopyAlone) {
  v1::NodeImage base = Image(6, 50);
  base.mutable_regions(7)->mutable_piece()->set_replica_group("g");
  std::vector<int64_t> steps(50, 6);
  steps[3] = steps[49] = 5;
  const v1::NodeImage neighbour = Image(5, 50, steps);  // the step before, two regions apart
  std::vector<std::pair<std::string, v1::NodeImage>> memories = {
      {"none", v1::NodeImage()},
      {"the neighbour", neighbour},
      {"fewer regions", Image(6, 20)},
      {"more regions", Image(6, 80)},
      {"another node's", [] {
         v1::NodeImage other = Image(6, 50);
         other.set_node_id(9);
         return other;
       }()},
  };
  for (int where : {0, 1, 2}) {
    v1::NodeImage unknown = neighbour;
    v1::ImageRegion& region = *unknown.mutable_regions(7);
    region.mutable_piece()->set_replica_group("g");  // equal to the base's but for the field
    AddUnknownField(where == 0   ? static_cast<google::protobuf::Message&>(unknown)
                    : where == 1 ? static_cast<google::protobuf::Message&>(region)
                                 : *region.mutable_piece());
    memories.emplace_back(absl::StrCat("an unknown field at ", where), std::move(unknown));
  }
  const std::string expected = ImageBytes(base);
  for (auto& [what, memory] : memories) {
    EXPECT_FALSE(AssignImage(base, memory)) << what << ": the base carries no unknown field";
    EXPECT_EQ(ImageBytes(memory), expected) << what;
  }
  // A base carrying such a field has it in the copy, wherever the memory's entry equals it.
  for (int where : {0, 1, 2}) {
    v1::NodeImage carrying = base;
    AddUnknownField(where == 0   ? static_cast<google::protobuf::Message&>(carrying)
                    : where == 1 ? static_cast<google::protobuf::Message&>(
                                       *carrying.mutable_regions(7))
                                 : *carrying.mutable_regions(7)->mutable_piece());
    for (v1::NodeImage memory : {base, neighbour}) {
      EXPECT_TRUE(AssignImage(carrying, memory)) << where;
      EXPECT_EQ(ImageBytes(memory), ImageBytes(carrying)) << where;
    }
  }
}

// Memory known to hold the image a copy was built on, and where the copy differs from it, takes
// the copy by those regions and the fields on top alone: here the memory differs at a region it
// was not said to, and the copy keeps that region as it was, so nothing else was read. Knowledge
// that does not fit the two images is not used: the copy compares every entry.
TEST(ImagePatchTest, MemoryKnownToDifferAtSomeRegionsTakesTheCopyThereAlone) {
  const v1::NodeImage base = Image(6, 50);
  std::vector<int64_t> steps(50, 6);
  steps[3] = steps[40] = 7;
  const v1::NodeImage next = Image(7, 50, steps);  // built on base, two regions captured anew
  v1::NodeImage unsaid = base;
  unsaid.mutable_regions(10)->set_dtype("bfloat16");
  ImageMemory memory{.image = base, .differs_at = std::vector<uint32_t>{3, 40}};
  EXPECT_FALSE(AssignImage(next, memory));
  EXPECT_EQ(ImageBytes(memory.image), ImageBytes(next));
  EXPECT_FALSE(memory.differs_at.has_value()) << "the memory is the copy now";
  memory = {.image = unsaid, .differs_at = std::vector<uint32_t>{3, 40}};
#ifdef NDEBUG
  // Nothing but those regions is read: a difference the memory does not declare stays.
  AssignImage(next, memory);
  EXPECT_EQ(memory.image.regions(10).dtype(), "bfloat16");
  EXPECT_EQ(memory.image.regions(40).step(), 7);
  EXPECT_EQ(memory.image.step(), 7);
  EXPECT_EQ(memory.image.ranks(0).latest_committed_step(), 7);
#else
  // Builds with assertions compare every entry after the copy: the undeclared difference is loud.
  EXPECT_DEATH(AssignImage(next, memory), "SameEntry");
#endif

  v1::NodeImage fewer = unsaid;
  fewer.mutable_regions()->RemoveLast();
  v1::NodeImage unknown_on_top = unsaid;
  AddUnknownField(unknown_on_top);
  v1::NodeImage next_unknown_on_top = next;
  AddUnknownField(next_unknown_on_top);
  const std::vector<std::tuple<std::string, v1::NodeImage, std::vector<uint32_t>,
                               const v1::NodeImage*>>
      unfit = {
          {"out of order", unsaid, {40, 3}, &next},
          {"repeated", unsaid, {3, 3, 40}, &next},
          {"beyond the regions", unsaid, {3, 40, 50}, &next},
          {"fewer regions", fewer, {3, 40}, &next},
          {"an unknown field on top of the memory", unknown_on_top, {3, 40}, &next},
          {"an unknown field on top of the copy", unsaid, {3, 40}, &next_unknown_on_top},
      };
  for (const auto& [what, image, differs_at, from] : unfit) {
    memory = {.image = image, .differs_at = differs_at};
    EXPECT_EQ(AssignImage(*from, memory), from == &next_unknown_on_top) << what;
    EXPECT_EQ(ImageBytes(memory.image), ImageBytes(*from)) << what;
  }
}

// A patched image built in memory known to hold its base but at some regions is the image built
// in any memory, and says whether it carries fields this build does not know, from its base or
// its changes.
TEST(ImagePatchTest, APatchedImageBuiltInMemoryKnownToHoldItsBaseIsTheSameImage) {
  const v1::NodeImage before = Image(5, 30);
  std::vector<int64_t> steps(30, 5);
  steps[8] = 6;
  const v1::NodeImage base = Image(6, 30, steps);  // built on `before` at region 8
  steps[20] = 7;
  for (int unknown_in : {-1, 0, 1}) {  // nowhere, in the base, in the changes
    v1::NodeImage on = base;
    if (unknown_in == 0) AddUnknownField(*on.mutable_regions(2));
    v1::NodeImage next = Image(7, 30, steps);
    if (unknown_in == 0) AddUnknownField(*next.mutable_regions(2));  // kept from the base
    if (unknown_in == 1) AddUnknownField(*next.mutable_regions(20));
    const ImagePatchOf of = *Patch(on, next);
    std::string expected_bytes;
    absl::StatusOr<v1::NodeImage> expected =
        PatchedImage(on, ImageBytes(on), of.changes, of.patch, expected_bytes);
    ASSERT_OK(expected) << unknown_in;
    // Memory known to be the base but at region 8, the base known to carry no unknown field.
    std::string bytes;
    bool unknown_fields = true;
    ImageMemory memory{.image = before};
    if (unknown_in != 0) memory.differs_at = std::vector<uint32_t>{8};
    absl::StatusOr<v1::NodeImage> built = PatchedImage(
        on, ImageBytes(on), of.changes, of.patch, bytes, std::move(memory), &unknown_fields);
    ASSERT_OK(built) << unknown_in;
    EXPECT_EQ(ImageBytes(*built), ImageBytes(*expected)) << unknown_in;
    EXPECT_EQ(bytes, expected_bytes) << unknown_in;
    EXPECT_EQ(unknown_fields, unknown_in >= 0) << unknown_in;
  }
}

TEST(ImagePatchTest, EveryFieldOfARegionCountsAsAChange) {
  // SameEntry compares each field by name: a field added to ImageRegion must be added there.
  EXPECT_EQ(v1::ImageRegion::descriptor()->field_count(), 9);
  EXPECT_EQ(v1::RegionPiece::descriptor()->field_count(), 3);
  const v1::NodeImage base = Image(6, 3);
  const std::vector<std::function<void(v1::ImageRegion&)>> edits = {
      [](v1::ImageRegion& r) { r.set_rank(9); },
      [](v1::ImageRegion& r) { r.set_region("other"); },
      [](v1::ImageRegion& r) { r.set_step(1); },
      [](v1::ImageRegion& r) { r.set_bytes(8192); },
      [](v1::ImageRegion& r) { r.set_dtype("bfloat16"); },
      [](v1::ImageRegion& r) { r.add_shape(2); },
      [](v1::ImageRegion& r) { r.set_chunk_bytes(1024); },
      [](v1::ImageRegion& r) { r.set_chunk_crcs(0, 1); },
      [](v1::ImageRegion& r) { r.mutable_piece(); },
      [](v1::ImageRegion& r) { r.mutable_piece()->set_replica_group("g"); },
      [](v1::ImageRegion& r) { r.mutable_piece()->set_offset(4); },
      [](v1::ImageRegion& r) { r.mutable_piece()->set_region_bytes(4); },
  };
  for (size_t edit = 0; edit < edits.size(); ++edit) {
    v1::NodeImage next = base;
    edits[edit](*next.mutable_regions(1));
    const std::optional<ImagePatchOf> of = Patch(base, next);
    ASSERT_TRUE(of.has_value());
    EXPECT_EQ(of->patch.changed_size(), 1) << "edit " << edit;
    std::string bytes;
    absl::StatusOr<v1::NodeImage> built = PatchedImage(base, {}, of->changes, of->patch, bytes);
    ASSERT_OK(built.status());
    EXPECT_EQ(bytes, ImageBytes(next)) << "edit " << edit;
  }
}

// Given the base's bytes, the patched image's bytes are spliced from them: the same bytes as the
// image serialized whole, whichever regions changed (the first, the last, several, every field of
// one), with pieces and rank records; a base carrying fields this build does not know is
// serialized whole, and base bytes that are not the base's never pass the CRC.
TEST(ImagePatchTest, BytesSplicedFromTheBasesAreTheWholeImagesBytes) {
  v1::NodeImage base = Image(6, 50);
  base.mutable_regions(7)->mutable_piece()->set_replica_group("g");
  base.mutable_regions(7)->mutable_piece()->set_offset(4096);
  base.add_ranks()->set_rank(1);
  for (const std::vector<int>& changed :
       std::vector<std::vector<int>>{{0}, {49}, {0, 7, 49}, {3, 4, 5, 6, 7, 8, 9, 10}}) {
    v1::NodeImage next = base;
    next.set_step(7);
    next.set_bytes(base.bytes() + 1);
    next.mutable_ranks(0)->set_latest_committed_step(7);
    for (int position : changed) {
      v1::ImageRegion& region = *next.mutable_regions(position);
      region.set_step(7);
      region.set_chunk_crcs(0, 99);
      region.set_region(region.region() + "-longer-name");
      region.add_shape(3);
    }
    const std::optional<ImagePatchOf> of = Patch(base, next);
    ASSERT_TRUE(of.has_value());
    std::string bytes = "left over";
    absl::StatusOr<v1::NodeImage> built =
        PatchedImage(base, ImageBytes(base), of->changes, of->patch, bytes);
    ASSERT_OK(built.status());
    EXPECT_EQ(bytes, ImageBytes(next)) << changed.size() << " changed";
    EXPECT_EQ(ImageBytes(*built), ImageBytes(next));
  }
  std::vector<int64_t> steps(50, 6);
  steps[2] = 7;
  const v1::NodeImage next = Image(7, 50, steps);
  const v1::NodeImage plain = Image(6, 50);
  const ImagePatchOf of = *Patch(plain, next);
  v1::NodeImage unknown = plain;
  AddUnknownField(unknown);
  v1::NodeImage unknown_next = next;
  AddUnknownField(unknown_next);
  const ImagePatchOf of_unknown = *Patch(unknown, unknown_next);
  std::string bytes;
  absl::StatusOr<v1::NodeImage> built = PatchedImage(unknown, ImageBytes(unknown),
                                                     of_unknown.changes, of_unknown.patch, bytes);
  ASSERT_OK(built.status());
  EXPECT_EQ(bytes, ImageBytes(unknown_next));
  // A base whose unchanged entry carries such a field, in bytes that put it before the entry's
  // known fields (as another build may): its bytes are not what this build serializes, so neither
  // the proposer nor a receiver splices them, and both make the image's bytes.
  std::string reordered;
  {
    v1::NodeImage head;
    head.set_node_id(plain.node_id());
    head.set_step(plain.step());
    head.set_bytes(plain.bytes());
    reordered = head.SerializeAsString();
    for (int position = 0; position < plain.regions_size(); ++position) {
      std::string entry = plain.regions(position).SerializeAsString();
      if (position == 20) entry.insert(0, "\x98\x06\x01");  // field 99, a varint of 1
      google::protobuf::io::StringOutputStream stream(&reordered);
      google::protobuf::io::CodedOutputStream coded(&stream);
      coded.WriteTag(v1::NodeImage::kRegionsFieldNumber << 3 | 2);
      coded.WriteVarint32(static_cast<uint32_t>(entry.size()));
      coded.WriteRaw(entry.data(), static_cast<int>(entry.size()));
    }
    v1::NodeImage tail;
    *tail.mutable_ranks() = plain.ranks();
    reordered += tail.SerializeAsString();
  }
  v1::NodeImage carrying;
  ASSERT_TRUE(carrying.ParseFromString(reordered));
  ASSERT_NE(ImageBytes(carrying), reordered);
  v1::NodeImage carrying_next = next;
  *carrying_next.mutable_regions(20) = carrying.regions(20);
  std::string proposed;
  const std::optional<ImagePatchOf> of_carrying =
      PatchOf(carrying, reordered, carrying_next, proposed);
  ASSERT_TRUE(of_carrying.has_value());
  EXPECT_EQ(proposed, ImageBytes(carrying_next));
  built = PatchedImage(carrying, reordered, of_carrying->changes, of_carrying->patch, bytes);
  ASSERT_OK(built.status());
  EXPECT_EQ(bytes, ImageBytes(carrying_next));
  v1::NodeImage other = plain;
  other.mutable_regions(30)->set_chunk_crcs(0, 5);
  EXPECT_EQ(PatchedImage(plain, ImageBytes(other), of.changes, of.patch, bytes).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(PatchedImage(plain, "not an image", of.changes, of.patch, bytes).status().code(),
            absl::StatusCode::kOk);
}

TEST(ImagePatchTest, ARegionListOfAnotherLengthOrADenseStepGoesWhole) {
  EXPECT_FALSE(Patch(Image(6, 10), Image(7, 11)).has_value());
  v1::NodeImage other = Image(7, 10);
  other.set_node_id(3);
  EXPECT_FALSE(Patch(Image(6, 10), other).has_value());
  // Half the regions changed go as a patch, more go whole.
  std::vector<int64_t> steps(10, 6);
  for (int i = 0; i < 5; ++i) steps[2 * i] = 7;
  EXPECT_EQ(Patch(Image(6, 10), Image(7, 10, steps))->patch.changed_size(), 5);
  steps[1] = 7;
  EXPECT_FALSE(Patch(Image(6, 10), Image(7, 10, steps)).has_value());
  EXPECT_FALSE(Patch(Image(6, 10), Image(7, 10)).has_value());
}

TEST(ImagePatchTest, APatchThatDoesNotFitTheBaseIsRefused) {
  const v1::NodeImage base = Image(6, 10);
  std::vector<int64_t> steps(10, 6);
  steps[2] = steps[5] = 7;
  const ImagePatchOf of = *Patch(base, Image(7, 10, steps));
  auto refused = [&](const v1::NodeImage& on, const v1::NodeImage& changes,
                     const v1::ImagePatch& patch, const std::string& mentions) {
    std::string bytes;
    const absl::Status status = PatchedImage(on, ImageBytes(on), changes, patch, bytes).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), mentions)) << status;
  };
  v1::ImagePatch patch = of.patch;
  patch.set_changed(1, 2);  // twice the same position
  refused(base, of.changes, patch, "does not follow");
  patch.set_changed(0, 5);  // out of order
  patch.set_changed(1, 2);
  refused(base, of.changes, patch, "does not follow");
  patch.set_changed(0, 2);
  patch.set_changed(1, 10);  // beyond the base's regions
  refused(base, of.changes, patch, "within the base image's 10 regions");
  patch = of.patch;
  patch.add_changed(9);
  refused(base, of.changes, patch, "names 3 changed regions and carries 2");
  v1::NodeImage other = base;
  other.set_node_id(3);
  refused(other, of.changes, of.patch, "node 3's image");
}

TEST(ImagePatchTest, ABaseThatDiffersFromTheCoordinatorsIsNeverBuiltOn) {
  // The receiver's record of the base step differs in a region the patch does not name: the image
  // it would build is not the coordinator's, and the CRC says so.
  const v1::NodeImage base = Image(6, 10);
  std::vector<int64_t> steps(10, 6);
  steps[2] = 7;
  const ImagePatchOf of = *Patch(base, Image(7, 10, steps));
  v1::NodeImage differs = base;
  differs.mutable_regions(8)->set_chunk_crcs(0, 12345);
  std::string bytes;
  const absl::Status status = PatchedImage(differs, ImageBytes(differs), of.changes, of.patch, bytes).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "is not the coordinator's")) << status;
}

}  // namespace
}  // namespace moesnap::daemon::cluster
