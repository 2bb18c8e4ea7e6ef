// What an Encode carries of its group's images: absent members' placeholders, images parsed into
// a replaced record's memory (and given back when the request is refused), and the step's images
// built and checked.
#include "daemon/cluster/encode_images.h"

#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/dynamic_message.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "daemon/cluster/image_patch.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

// Node 1's view of a job of three nodes in one group (2,1).
std::unique_ptr<const Topology> NodeOne() {
  ClusterOptions options;
  options.job = "images";
  options.node_count = 3;
  options.data_units = 2;
  options.parity_units = 1;
  options.advertise_host = "127.0.0.1";
  options.tls.insecure = true;
  absl::StatusOr<std::unique_ptr<const Topology>> topology =
      Topology::Create(1, options, uint64_t{64} << 20);
  EXPECT_OK(topology);
  return *std::move(topology);
}

// Node `id`'s image of step `step`: `regions` regions of 4 KiB.
v1::NodeImage Image(uint32_t id, int64_t step, int regions) {
  v1::NodeImage image;
  image.set_node_id(id);
  image.set_step(step);
  for (int i = 0; i < regions; ++i) {
    v1::ImageRegion& region = *image.add_regions();
    region.set_rank(id);
    region.set_region("expert" + std::to_string(i));
    region.set_step(step);
    region.set_bytes(4096);
    region.set_dtype("float32");
    region.set_chunk_bytes(4096);
    region.add_chunk_crcs(static_cast<uint32_t>(step * 100 + i));
  }
  image.set_bytes(4096 * static_cast<uint64_t>(regions));
  return image;
}

v1::EncodeRequest Whole(int64_t step, int regions) {
  v1::EncodeRequest request;
  request.set_coordinator(0);
  request.set_step(step);
  request.set_token(5);
  request.set_timeout_ms(1000);
  for (uint32_t id : {0, 1, 2}) request.add_group_images(ImageBytes(Image(id, step, regions)));
  return request;
}

// A record replaced by a commit, whose images' memory a step's images are parsed in.
SpareRecord Replaced(int regions) {
  auto record = std::make_shared<v1::JournalCluster>();
  for (uint32_t id : {0, 1, 2}) *record->add_group_images() = Image(id, 1, regions);
  return SpareRecord{.record = std::move(record)};
}

TEST(EncodeImagesTest, WholeImagesAreParsedInTheReplacedRecordsMemoryAndBuiltAsSent) {
  const std::unique_ptr<const Topology> topology = NodeOne();
  const v1::EncodeRequest request = Whole(3, 50);
  SentImages sent = ParsedImages(request, *topology, {}, Replaced(80));
  ASSERT_OK(sent.status);
  EXPECT_EQ(sent.parsed_in_spare, (std::vector<int>{0, 1, 2}));
  const ClusterStore::RecordWithBytes none{std::make_shared<const v1::JournalCluster>(), nullptr};
  absl::StatusOr<GroupImages> images = GroupImagesOf(request, *topology, none, {}, std::move(sent));
  ASSERT_OK(images);
  for (int position = 0; position < 3; ++position) {
    EXPECT_EQ(ImageBytes(images->images[position]), request.group_images(position)) << position;
    EXPECT_EQ(images->bytes[position], request.group_images(position)) << position;
  }
}

TEST(EncodeImagesTest, ARefusedRequestGivesItsImagesMemoryBack) {
  const std::unique_ptr<const Topology> topology = NodeOne();
  v1::EncodeRequest request = Whole(3, 50);
  SentImages sent = ParsedImages(request, *topology, {}, Replaced(80));
  ASSERT_OK(sent.status);
  const std::shared_ptr<v1::JournalCluster> unused = std::move(sent).Unused().record;
  ASSERT_NE(unused, nullptr);
  ASSERT_EQ(unused->group_images_size(), 3);
  // The memory went back holding what was parsed in it: 50 regions where the record had 80.
  for (const v1::NodeImage& image : unused->group_images()) EXPECT_EQ(image.regions_size(), 50);
  // One that is not an image at all is refused by name, its memory given back the same way.
  *request.mutable_group_images(2) = "\xff";
  sent = ParsedImages(request, *topology, {}, Replaced(80));
  EXPECT_STATUS(sent.status, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(sent.status.message(), "step 3: image 2")) << sent.status;
  EXPECT_EQ(std::move(sent).Unused().record->group_images_size(), 3);
}

// A patch stands for a live member of the group, once: one for another group's node, an absent
// member or a member patched twice is refused by name before any image is parsed.
TEST(EncodeImagesTest, APatchIsOfALiveMemberAndItsOnlyOne) {
  const std::unique_ptr<const Topology> topology = NodeOne();
  v1::EncodeRequest request = Whole(3, 2);
  v1::ImagePatch patch;
  patch.add_changed(0);
  for (const auto& [patched, absent] : std::vector<std::pair<std::vector<uint32_t>, int>>{
           {{5}, -1}, {{2}, 2}, {{0, 0}, -1}}) {
    request.clear_patches();
    for (uint32_t id : patched) {
      patch.set_node_id(id);
      *request.add_patches() = patch;
    }
    std::set<int> positions;
    if (absent >= 0) positions.insert(absent);
    SentImages sent = ParsedImages(request, *topology, positions, Replaced(2));
    EXPECT_STATUS(sent.status, absl::StatusCode::kInvalidArgument) << patched.front();
    EXPECT_TRUE(absl::StrContains(sent.status.message(), "an absent one, or one patched twice"))
        << sent.status;
    EXPECT_TRUE(sent.parsed_in_spare.empty());
  }
  request.clear_patches();
  patch.set_node_id(0);
  *request.add_patches() = patch;
  // A patch of a member that carries its changes only: node 0's changed region 0.
  v1::NodeImage changes = Image(0, 3, 1);
  *request.mutable_group_images(0) = ImageBytes(changes);
  SentImages sent = ParsedImages(request, *topology, {}, Replaced(2));
  ASSERT_OK(sent.status);
  EXPECT_EQ(sent.patches.size(), 1u);
  EXPECT_EQ(sent.parsed_in_spare, (std::vector<int>{1, 2}));
}

// A patched member's image is checked at the regions its patch changed, on the record's images
// (checked when the record was made): one whose sizes no longer add up is refused by name.
TEST(EncodeImagesTest, APatchedImageIsBuiltAndCheckedAtTheRegionsItChanged) {
  const std::unique_ptr<const Topology> topology = NodeOne();
  auto record = std::make_shared<v1::JournalCluster>();
  record->set_committed_step(2);
  auto image_bytes = std::make_shared<std::vector<std::string>>();
  for (uint32_t id : {0, 1, 2}) {
    *record->add_group_images() = Image(id, 2, 3);
    image_bytes->push_back(ImageBytes(record->group_images(static_cast<int>(id))));
  }
  const ClusterStore::RecordWithBytes held{record, image_bytes};
  for (const bool adds_up : {true, false}) {
    // Node 0's image of step 3: its second region captured again, twice the size.
    v1::NodeImage image = Image(0, 2, 3);
    image.set_step(3);
    v1::ImageRegion& region = *image.mutable_regions(1);
    region.set_step(3);
    region.set_bytes(8192);
    region.add_chunk_crcs(7);
    image.set_bytes(adds_up ? 4096 + 8192 + 4096 : 3 * 4096);
    std::string bytes;
    std::optional<ImagePatchOf> patch =
        PatchOf(record->group_images(0), held.ImageBytesOf(0), image, bytes);
    ASSERT_TRUE(patch.has_value());
    v1::EncodeRequest request = Whole(3, 3);
    request.set_base_step(2);
    *request.mutable_group_images(0) = ImageBytes(patch->changes);
    *request.add_patches() = patch->patch;
    SentImages sent = ParsedImages(request, *topology, {}, {});
    ASSERT_OK(sent.status);
    absl::StatusOr<GroupImages> built =
        GroupImagesOf(request, *topology, held, {}, std::move(sent));
    if (adds_up) {
      ASSERT_OK(built);
      EXPECT_EQ(ImageBytes(built->images[0]), ImageBytes(image));
      EXPECT_EQ(built->changed_regions.at(0), std::vector<uint32_t>{1});
    } else {
      EXPECT_STATUS(built, absl::StatusCode::kInvalidArgument);
      EXPECT_TRUE(absl::StrContains(built.status().message(),
                                    "step 3: image of node 0: its regions add up to more than "
                                    "16384 bytes, not the 12288"))
          << built.status();
    }
  }
}

// What a spare record knows of where its images differ from the committed record's is handed out
// with the memory, once, and only for the record it was said of.
TEST(EncodeImagesTest, ASpareRecordTellsWhereItDiffersForTheRecordBuiltOnItOnly) {
  const auto committed = std::make_shared<const v1::JournalCluster>();
  const auto another = std::make_shared<const v1::JournalCluster>();
  SpareRecord spare = Replaced(4);
  spare.base_of = committed;
  spare.differs_at = {{0, {1, 3}}, {1, {}}, {2, {2}}};
  ImageMemory memory = spare.Memory(0, committed);
  EXPECT_EQ(memory.image.regions_size(), 4);
  EXPECT_EQ(memory.differs_at, (std::vector<uint32_t>{1, 3}));
  memory = spare.Memory(0, committed);
  EXPECT_EQ(memory.image.regions_size(), 0) << "taken already";
  EXPECT_FALSE(memory.differs_at.has_value());
  EXPECT_FALSE(spare.Memory(1, another).differs_at.has_value());
  EXPECT_FALSE(spare.Memory(2, nullptr).differs_at.has_value());
  EXPECT_TRUE(spare.differs_at.empty());
  // Nor for a record at the address of one gone: the record it was said of is told by its owner.
  SpareRecord of_gone = Replaced(4);
  of_gone.differs_at = {{0, {1}}};
  std::shared_ptr<const v1::JournalCluster> gone = std::make_shared<const v1::JournalCluster>();
  of_gone.base_of = gone;
  const v1::JournalCluster* address = gone.get();
  gone.reset();
  EXPECT_FALSE(IsRecord(of_gone.base_of, std::shared_ptr<const v1::JournalCluster>(
                                             std::shared_ptr<const v1::JournalCluster>(), address)));
  EXPECT_FALSE(of_gone.Memory(0, nullptr).differs_at.has_value());
}

// Node `id`'s image of `step` whose region i was captured at `steps[i]`.
v1::NodeImage ImageOf(uint32_t id, int64_t step, const std::vector<int64_t>& steps) {
  v1::NodeImage image = Image(id, step, static_cast<int>(steps.size()));
  for (size_t i = 0; i < steps.size(); ++i) {
    v1::ImageRegion& region = *image.mutable_regions(static_cast<int>(i));
    region.set_step(steps[i]);
    region.set_chunk_crcs(0, static_cast<uint32_t>(steps[i] * 100 + static_cast<int64_t>(i)));
  }
  return image;
}

// Step after step, each built in the memory of the record its base was built on, as a participant
// builds them (with the regions where that memory differs from the base), the images are the ones
// the members captured: patched at other regions each step, absent for two steps, sent whole for
// one, and with a refused request's images parsed into the memory between two steps.
TEST(EncodeImagesTest, StepsBuiltInTheMemoryOfTheirBasesBaseAreTheImagesCaptured) {
  const std::unique_ptr<const Topology> topology = NodeOne();
  constexpr int kRegions = 12;
  std::vector<std::vector<int64_t>> captured(3, std::vector<int64_t>(kRegions, 1));
  auto truth = [&](int position, int64_t step) {
    return ImageOf(static_cast<uint32_t>(position), step, captured[position]);
  };
  auto record = std::make_shared<v1::JournalCluster>();
  auto record_bytes = std::make_shared<std::vector<std::string>>();
  record->set_committed_step(1);
  for (int position = 0; position < 3; ++position) {
    *record->add_group_images() = truth(position, 1);
    record_bytes->push_back(ImageBytes(record->group_images(position)));
  }
  SpareRecord spare = Replaced(kRegions);
  for (int64_t step = 2; step <= 9; ++step) {
    const std::set<int> absent = step == 4 || step == 5 ? std::set<int>{2} : std::set<int>{};
    const bool member_one_whole = step == 6;
    // Members 0 and 1 capture other regions anew each step, member 2 when it is not absent.
    captured[0][step % kRegions] = step;
    captured[1][(3 * step) % kRegions] = captured[1][(3 * step + 1) % kRegions] = step;
    if (absent.empty()) captured[2][(5 * step) % kRegions] = step;
    const ClusterStore::RecordWithBytes held{record, record_bytes};
    v1::EncodeRequest request = Whole(step, kRegions);
    request.set_base_step(step - 1);
    for (int position = 0; position < 3; ++position) {
      if (absent.contains(position)) {
        v1::NodeImage placeholder;
        placeholder.set_node_id(static_cast<uint32_t>(position));
        *request.mutable_group_images(position) = ImageBytes(placeholder);
        request.add_absent_nodes(static_cast<uint32_t>(position));
        continue;
      }
      const v1::NodeImage image = truth(position, step);
      std::string bytes;
      std::optional<ImagePatchOf> patch = PatchOf(record->group_images(position),
                                                  held.ImageBytesOf(position), image, bytes);
      ASSERT_TRUE(patch.has_value()) << step;
      if (position == 1 && member_one_whole) {
        *request.mutable_group_images(position) = ImageBytes(image);
      } else {
        *request.mutable_group_images(position) = ImageBytes(patch->changes);
        *request.add_patches() = patch->patch;
      }
    }
    if (step == 8) {
      // A request refused after its images were parsed: member 1's, sent whole, went into the
      // memory its image is built in, and back; members 0 and 2 came as patches, their memory
      // untouched and still known.
      v1::EncodeRequest refused = request;
      *refused.mutable_group_images(1) = ImageBytes(Image(1, step, kRegions));
      refused.clear_patches();
      for (const v1::ImagePatch& patch : request.patches()) {
        if (patch.node_id() != 1) *refused.add_patches() = patch;
      }
      SentImages parsed = ParsedImages(refused, *topology, {}, std::move(spare));
      ASSERT_OK(parsed.status);
      EXPECT_EQ(parsed.parsed_in_spare, std::vector<int>{1});
      spare = std::move(parsed).Unused();
      EXPECT_EQ(spare.differs_at.size(), 2u);
      EXPECT_FALSE(spare.differs_at.contains(1));
    }
    SentImages sent = ParsedImages(request, *topology, absent, std::move(spare));
    ASSERT_OK(sent.status) << step;
    absl::StatusOr<GroupImages> built =
        GroupImagesOf(request, *topology, held, absent, std::move(sent));
    ASSERT_OK(built) << step;
    for (int position = 0; position < 3; ++position) {
      const std::string expected = ImageBytes(absent.contains(position)
                                                  ? record->group_images(position)
                                                  : truth(position, step));
      EXPECT_EQ(ImageBytes(built->images[position]), expected) << step << " " << position;
      EXPECT_EQ(built->bytes[position], expected) << step << " " << position;
    }
    EXPECT_EQ(built->changed_regions.contains(1), !member_one_whole) << step;
    EXPECT_TRUE(built->unknown_fields.empty());
    // The commit: the record replaced is the next step's memory, built on as it says.
    auto committed = std::make_shared<v1::JournalCluster>();
    committed->set_committed_step(step);
    for (v1::NodeImage& image : built->images) *committed->add_group_images() = std::move(image);
    spare = SpareRecord{.record = std::move(record), .base_of = committed,
                        .differs_at = std::move(built->changed_regions)};
    record = std::move(committed);
    record_bytes = std::make_shared<std::vector<std::string>>(std::move(built->bytes));
  }
}

TEST(EncodeImagesTest, AnAbsentMembersEntryIsAPlaceholderNamingItAlone) {
  const std::unique_ptr<const Topology> topology = NodeOne();
  v1::EncodeRequest request = Whole(3, 2);
  request.set_base_step(2);
  request.add_absent_nodes(2);
  v1::NodeImage placeholder;
  placeholder.set_node_id(2);
  *request.mutable_group_images(2) = ImageBytes(placeholder);
  absl::StatusOr<std::set<int>> absent = AbsentPositions(request, *topology);
  ASSERT_OK(absent);
  EXPECT_EQ(*absent, (std::set<int>{2}));
  for (uint32_t named : {0, 7}) {
    placeholder.set_node_id(named);
    *request.mutable_group_images(2) = ImageBytes(placeholder);
    EXPECT_STATUS(AbsentPositions(request, *topology).status(),
                  absl::StatusCode::kInvalidArgument)
        << "a placeholder naming node " << named;
  }
  *request.mutable_group_images(2) = ImageBytes(Image(2, 3, 1));
  EXPECT_STATUS(AbsentPositions(request, *topology).status(), absl::StatusCode::kInvalidArgument);
}

// Builds from before images travelled as bytes declared them messages: a daemon of either build
// reads the other's Encode requests (and proposals) alike, so a job can be upgraded node by node.
TEST(EncodeImagesTest, ImagesAsBytesAreOnTheWireWhatImagesAsMessagesWere) {
  namespace pb = google::protobuf;
  // moesnap.proto as it was: EncodeRequest.group_images a repeated NodeImage.
  pb::FileDescriptorProto file;
  v1::EncodeRequest::descriptor()->file()->CopyTo(&file);
  int changed = 0;
  for (pb::DescriptorProto& message : *file.mutable_message_type()) {
    if (message.name() != "EncodeRequest") continue;
    for (pb::FieldDescriptorProto& field : *message.mutable_field()) {
      if (field.name() != "group_images") continue;
      field.set_type(pb::FieldDescriptorProto::TYPE_MESSAGE);
      field.set_type_name(".moesnap.v1.NodeImage");
      ++changed;
    }
  }
  ASSERT_EQ(changed, 1);
  pb::DescriptorPool pool;
  ASSERT_NE(pool.BuildFile(file), nullptr);
  pb::DynamicMessageFactory factory(&pool);
  const pb::Descriptor* earlier = pool.FindMessageTypeByName("moesnap.v1.EncodeRequest");
  ASSERT_NE(earlier, nullptr);
  const pb::FieldDescriptor* images = earlier->FindFieldByName("group_images");
  ASSERT_EQ(images->type(), pb::FieldDescriptor::TYPE_MESSAGE);

  // This build's request, read by the earlier one: the same images, field for field.
  const v1::EncodeRequest request = Whole(3, 20);
  std::unique_ptr<pb::Message> old(factory.GetPrototype(earlier)->New());
  ASSERT_TRUE(old->ParseFromString(request.SerializeAsString()));
  ASSERT_EQ(old->GetReflection()->FieldSize(*old, images), 3);
  for (int position = 0; position < 3; ++position) {
    const pb::Message& image = old->GetReflection()->GetRepeatedMessage(*old, images, position);
    EXPECT_EQ(image.SerializeAsString(), request.group_images(position)) << position;
  }
  // And the earlier build's, read by this one: each image's bytes.
  v1::EncodeRequest read;
  ASSERT_TRUE(read.ParseFromString(old->SerializeAsString()));
  for (int position = 0; position < 3; ++position) {
    EXPECT_EQ(read.group_images(position), request.group_images(position)) << position;
  }
}

}  // namespace
}  // namespace moesnap::daemon::cluster
