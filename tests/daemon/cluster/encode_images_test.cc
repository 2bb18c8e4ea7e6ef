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
std::shared_ptr<v1::JournalCluster> Replaced(int regions) {
  auto record = std::make_shared<v1::JournalCluster>();
  for (uint32_t id : {0, 1, 2}) *record->add_group_images() = Image(id, 1, regions);
  return record;
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
  const std::shared_ptr<v1::JournalCluster> unused = std::move(sent).Unused();
  ASSERT_NE(unused, nullptr);
  ASSERT_EQ(unused->group_images_size(), 3);
  // The memory went back holding what was parsed in it: 50 regions where the record had 80.
  for (const v1::NodeImage& image : unused->group_images()) EXPECT_EQ(image.regions_size(), 50);
  // One that is not an image at all is refused by name, its memory given back the same way.
  *request.mutable_group_images(2) = "\xff";
  sent = ParsedImages(request, *topology, {}, Replaced(80));
  EXPECT_STATUS(sent.status, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(sent.status.message(), "step 3: image 2")) << sent.status;
  EXPECT_EQ(std::move(sent).Unused()->group_images_size(), 3);
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
    SentImages sent = ParsedImages(request, *topology, {}, nullptr);
    ASSERT_OK(sent.status);
    absl::StatusOr<GroupImages> built =
        GroupImagesOf(request, *topology, held, {}, std::move(sent));
    if (adds_up) {
      ASSERT_OK(built);
      EXPECT_EQ(ImageBytes(built->images[0]), ImageBytes(image));
      EXPECT_EQ(built->patched_regions.at(0), std::vector<uint32_t>{1});
    } else {
      EXPECT_STATUS(built, absl::StatusCode::kInvalidArgument);
      EXPECT_TRUE(absl::StrContains(built.status().message(),
                                    "step 3: image of node 0: its regions add up to more than "
                                    "16384 bytes, not the 12288"))
          << built.status();
    }
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
