// Peer request checks: each hostile field is refused with a message naming it; what a real
// coordinator, rebuilder or restorer sends passes.
#include "daemon/cluster/peer_checks.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "absl/strings/match.h"
#include "daemon/region_limits.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

PeerLimits Limits() {
  return {.node_count = 6, .group_size = 3, .unit_bytes = 64 << 10, .commit_timeout_ms = 5000,
          .max_image_bytes = uint64_t{3} << 30};
}

// Node `id`'s image of two regions of `bytes` each, in chunks of 1 KiB.
v1::NodeImage Image(uint32_t id, uint64_t bytes = 4096) {
  v1::NodeImage image;
  image.set_node_id(id);
  image.set_step(7);
  for (const char* name : {"weights", "adam.m"}) {
    v1::ImageRegion* region = image.add_regions();
    region->set_rank(id);
    region->set_region(name);
    region->set_step(7);
    region->set_bytes(bytes);
    region->set_dtype("float32");
    region->add_shape(static_cast<int64_t>(bytes / 4));
    region->set_chunk_bytes(1024);
    for (uint64_t chunk = 0; chunk < (bytes + 1023) / 1024; ++chunk) region->add_chunk_crcs(1);
  }
  image.set_bytes(2 * bytes);
  return image;
}

// `bytes`, a NodeImage serialized as requests carry it, changed by `change`.
template <typename Change>
void Edit(std::string* bytes, Change change) {
  v1::NodeImage image;
  ASSERT_TRUE(image.ParseFromString(*bytes));
  change(image);
  *bytes = image.SerializeAsString();
}

// A proposal's fields, then its image, as the coordinator checks them.
absl::Status CheckProposal(const v1::ProposeRequest& request) {
  if (absl::Status status = CheckPropose(request, Limits()); !status.ok()) return status;
  v1::NodeImage image;
  return request.has_image() ? ParseProposedImage(request, Limits(), image) : absl::OkStatus();
}

// An Encode's fields, then its images, as the participant checks them.
absl::Status CheckEncoding(const v1::EncodeRequest& request) {
  if (absl::Status status = CheckEncode(request, Limits()); !status.ok()) return status;
  std::vector<v1::NodeImage> images;
  return ParseEncodeImages(request, Limits(), images);
}

v1::EncodeRequest Encode() {
  v1::EncodeRequest request;
  request.set_coordinator(0);
  request.set_step(7);
  request.set_token(12);
  request.set_timeout_ms(5000);
  request.set_base_step(6);
  for (uint32_t id : {3, 4, 5}) request.add_group_images(Image(id).SerializeAsString());
  return request;
}

void ExpectRefused(const absl::Status& status, const std::string& mentions) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), mentions))
      << "'" << status.message() << "' does not mention '" << mentions << "'";
}

TEST(PeerChecksTest, WhatARealPeerSendsPasses) {
  EXPECT_OK(CheckEncoding(Encode()));
  v1::PrepareRequest prepare;
  prepare.set_coordinator(5);
  prepare.set_step(1);
  prepare.set_token(1);
  prepare.set_timeout_ms(5000);
  EXPECT_OK(CheckPrepare(prepare, Limits()));
  v1::ProposeRequest propose;
  propose.set_from_node(5);
  propose.set_step(std::numeric_limits<int64_t>::max());  // judged by the coordinator's state
  EXPECT_OK(CheckProposal(propose));
  propose.set_step(7);
  propose.set_image(Image(5).SerializeAsString());
  propose.set_committed_step(6);
  propose.set_token(12);
  EXPECT_OK(CheckProposal(propose));
  v1::JournalCluster record;
  EXPECT_OK(CheckGroupRecord(record, {3, 4, 5}, Limits()));  // a node that holds no step
  for (uint32_t id : {3, 4, 5}) *record.add_group_images() = Image(id);
  EXPECT_OK(CheckGroupRecord(record, {3, 4, 5}, Limits()));
  v1::NodeImage empty = Image(2, 0);
  EXPECT_OK(CheckNodeImage(empty, Limits()));
}

TEST(PeerChecksTest, NodesOutsideTheJobAreRefused) {
  v1::ProposeRequest propose;
  propose.set_from_node(6);
  ExpectRefused(CheckProposal(propose), "from_node is node 6");
  v1::SendUnitsRequest units;
  units.set_to_node(1u << 31);
  ExpectRefused(CheckSendUnits(units, Limits()), "to_node");
  v1::EncodeRequest encode = Encode();
  encode.set_coordinator(6);
  ExpectRefused(CheckEncoding(encode), "coordinator");
}

TEST(PeerChecksTest, AProposalsImageIsTheProposersOwnOfTheStepOnAnEarlierStep) {
  auto proposal = [] {
    v1::ProposeRequest request;
    request.set_from_node(5);
    request.set_step(7);
    request.set_image(Image(5).SerializeAsString());
    request.set_committed_step(6);
    request.set_token(12);
    return request;
  };
  v1::ProposeRequest request = proposal();
  request.set_from_node(4);
  ExpectRefused(CheckProposal(request), "node 4 proposes step 7 with the image of node 5");
  request = proposal();
  request.set_step(8);
  ExpectRefused(CheckProposal(request), "with the image of node 5's step 7");
  request = proposal();
  request.set_committed_step(7);
  ExpectRefused(CheckProposal(request), "committed step 7 is not before step 7");
  request = proposal();
  request.set_token(0);
  ExpectRefused(CheckProposal(request), "0 is not positive");
  request = proposal();
  Edit(request.mutable_image(), [](v1::NodeImage& image) { image.set_bytes(image.bytes() + 1); });
  ExpectRefused(CheckProposal(request), "regions add up to");
  request = proposal();
  request.set_image("\xff");
  ExpectRefused(CheckProposal(request), "the proposed image (1 bytes) is not a node image");
}

// A node's answer to the coordinator's Prepare: its own valid image of the step and a committed
// step before it, or, rebuilding, an image of its id alone.
TEST(PeerChecksTest, APrepareAnswerIsTheNodesOwnValidImageOfTheStep) {
  v1::PrepareResponse answer;
  *answer.mutable_image() = Image(4);
  answer.set_committed_step(6);
  EXPECT_OK(CheckPrepareAnswer(answer, 4, 7, Limits()));
  ExpectRefused(CheckPrepareAnswer(answer, 3, 7, Limits()), "node 3 answered its Prepare of step 7 with the image of node 4");
  ExpectRefused(CheckPrepareAnswer(answer, 4, 8, Limits()), "its image of step 7");
  answer.set_committed_step(7);
  ExpectRefused(CheckPrepareAnswer(answer, 4, 7, Limits()), "committed step 7, not before the step");
  answer.set_committed_step(6);
  answer.mutable_image()->mutable_regions(1)->add_chunk_crcs(1);
  ExpectRefused(CheckPrepareAnswer(answer, 4, 7, Limits()), "an invalid image: image of node 4: region of rank 4");
  answer.mutable_image()->mutable_regions(1)->mutable_chunk_crcs()->RemoveLast();
  answer.mutable_image()->set_bytes(kMax);
  ExpectRefused(CheckPrepareAnswer(answer, 4, 7, Limits()), "an invalid image");
  answer.mutable_image()->set_bytes(2 * 4096);
  answer.set_receiver(true);
  ExpectRefused(CheckPrepareAnswer(answer, 4, 7, Limits()), "parity receiver, yet it does not rebuild");
  answer.set_receiver(false);
  answer.clear_committed_step();  // nothing committed yet
  EXPECT_OK(CheckPrepareAnswer(answer, 4, 7, Limits()));
  // A node of another group may hold more than this node's pool bounds: its members check that.
  const uint64_t larger = Limits().max_image_bytes + 1024;
  v1::ImageRegion& weights = *answer.mutable_image()->mutable_regions(0);
  weights.set_bytes(larger);
  weights.set_chunk_bytes(larger);
  weights.mutable_chunk_crcs()->Truncate(1);
  answer.mutable_image()->set_bytes(larger + 4096);
  EXPECT_OK(CheckPrepareAnswer(answer, 4, 7, Limits()));

  v1::PrepareResponse rebuilding;
  rebuilding.set_rebuilding(true);
  rebuilding.set_receiver(true);
  rebuilding.mutable_image()->set_node_id(4);
  rebuilding.set_committed_step(5);
  EXPECT_OK(CheckPrepareAnswer(rebuilding, 4, 7, Limits()));
  ExpectRefused(CheckPrepareAnswer(rebuilding, 5, 7, Limits()), "the image of node 4");
  *rebuilding.mutable_image() = Image(4);
  ExpectRefused(CheckPrepareAnswer(rebuilding, 4, 7, Limits()), "yet it rebuilds");
}

TEST(PeerChecksTest, CoordinatorCallsAreBoundedInTimeTokenAndBase) {
  v1::PrepareRequest prepare;
  prepare.set_coordinator(0);
  prepare.set_step(3);
  prepare.set_token(1);
  prepare.set_timeout_ms(std::numeric_limits<uint32_t>::max());
  ExpectRefused(CheckPrepare(prepare, Limits()), "commit timeout");
  prepare.set_timeout_ms(10);
  prepare.set_token(0);
  ExpectRefused(CheckPrepare(prepare, Limits()), "token 0");
  prepare.set_token(-5);
  ExpectRefused(CheckPrepare(prepare, Limits()), "token -5");
  prepare.set_token(2);
  prepare.set_base_step(3);
  ExpectRefused(CheckPrepare(prepare, Limits()), "base step 3 is not before step 3");
  v1::EncodeRequest encode = Encode();
  encode.set_timeout_ms(5001);
  ExpectRefused(CheckEncoding(encode), "commit timeout");
}

TEST(PeerChecksTest, GroupImagesAreCountedAndEachChecked) {
  v1::EncodeRequest encode = Encode();
  encode.mutable_group_images()->RemoveLast();
  ExpectRefused(CheckEncoding(encode), "2 images for a group of 3");
  encode = Encode();
  encode.add_group_images(Image(5).SerializeAsString());
  ExpectRefused(CheckEncoding(encode), "4 images");
  v1::JournalCluster record;
  record.set_committed_step(6);  // a committed step is its group's images of it: none is nothing
  ExpectRefused(CheckGroupRecord(record, {3, 4, 5}, Limits()), "0 images for a group of 3");
  for (uint32_t id : {3, 4, 5}) *record.add_group_images() = Image(id);
  EXPECT_OK(CheckGroupRecord(record, {3, 4, 5}, Limits()));
  ExpectRefused(CheckGroupRecord(record, {0, 1, 2}, Limits()), "is node 3's, not node 0's");
  record.mutable_group_images()->RemoveLast();
  ExpectRefused(CheckGroupRecord(record, {3, 4, 5}, Limits()), "2 images for a group of 3");
  *record.add_group_images() = Image(5);
  v1::JournalParity* parity = record.add_parity();
  parity->set_bytes(kMax);
  ExpectRefused(CheckGroupRecord(record, {3, 4, 5}, Limits()), "above the unit");
}

TEST(PeerChecksTest, ImageSizesMustAddUpWithoutWrapping) {
  v1::NodeImage image = Image(1);
  image.set_bytes(image.bytes() + 1);
  ExpectRefused(CheckNodeImage(image, Limits()), "regions add up to 8192 bytes, not the 8193");
  // Two regions whose sizes wrap to the image's size in 64 bits.
  image = Image(1);
  image.mutable_regions(0)->set_bytes(kMax - 4095);
  image.mutable_regions(1)->set_bytes(8192);
  image.set_bytes(4096);
  EXPECT_STATUS(CheckNodeImage(image, Limits()), absl::StatusCode::kInvalidArgument);
  // Sizes beyond what the pool could ever hold parity for, before anything is sized by them.
  image = Image(1);
  image.set_bytes(kMax);
  ExpectRefused(CheckNodeImage(image, Limits()), "this node's pool could hold parity for");
  image = Image(1, Limits().max_image_bytes + 1);
  ExpectRefused(CheckNodeImage(image, Limits()), "above the");
}

TEST(PeerChecksTest, APatchedImageCheckedAtItsChangedRegionsIsJudgedAsWhenCheckedWhole) {
  const v1::NodeImage base = Image(4);
  ASSERT_OK(CheckNodeImage(base, Limits()));
  // The base with its second region changed (twice the size), as PatchedImage builds it.
  auto patched = [&](auto change) {
    v1::NodeImage image = base;
    image.set_step(8);
    v1::ImageRegion& region = *image.mutable_regions(1);
    region.set_step(8);
    region.set_bytes(8192);
    for (int chunk = 0; chunk < 4; ++chunk) region.add_chunk_crcs(2);
    image.set_bytes(4096 + 8192);
    change(image, region);
    return image;
  };
  const std::vector<uint32_t> changed = {1};
  auto judged_alike = [&](const v1::NodeImage& image, const std::string& mentions) {
    const absl::Status whole = CheckNodeImage(image, Limits());
    const absl::Status at_changes = CheckPatchedImage(base, image, changed, Limits());
    EXPECT_EQ(whole, at_changes);
    if (mentions.empty()) {
      EXPECT_OK(at_changes);
    } else {
      ExpectRefused(at_changes, mentions);
    }
  };
  judged_alike(patched([](v1::NodeImage&, v1::ImageRegion&) {}), "");
  judged_alike(patched([](v1::NodeImage& image, v1::ImageRegion&) { image.set_bytes(8192); }),
               "regions add up to more than 12288 bytes, not the 8192");
  judged_alike(patched([](v1::NodeImage& image, v1::ImageRegion&) {
                 image.set_bytes(image.bytes() + 1);
               }),
               "regions add up to 12288 bytes, not the 12289");
  judged_alike(patched([](v1::NodeImage&, v1::ImageRegion& region) { region.set_region(""); }),
               "its name is 0 bytes");
  judged_alike(patched([](v1::NodeImage&, v1::ImageRegion& region) {
                 region.mutable_chunk_crcs()->RemoveLast();
               }),
               "lists 7 chunk CRCs");
  judged_alike(patched([](v1::NodeImage& image, v1::ImageRegion& region) {
                 region.set_bytes(Limits().max_image_bytes + 1);
                 image.set_bytes(kMax);
               }),
               "this node's pool could hold parity for");
  judged_alike(patched([](v1::NodeImage& image, v1::ImageRegion&) { image.set_node_id(6); }),
               "but the job has 6 nodes");
  judged_alike(patched([](v1::NodeImage& image, v1::ImageRegion&) {
                 for (int rank = 0; rank <= PeerLimits::kMaxRanksPerImage; ++rank) {
                   image.add_ranks()->set_rank(rank);
                 }
               }),
               "ranks, above");
  // What the whole check cannot see: a changed position outside the image, a region more or
  // fewer than the base's, and a base that was never checked.
  const v1::NodeImage image = patched([](v1::NodeImage&, v1::ImageRegion&) {});
  const std::vector<uint32_t> outside = {2};
  ExpectRefused(CheckPatchedImage(base, image, outside, Limits()), "changed region 2");
  // Positions out of order would count a region's size twice.
  const std::vector<uint32_t> twice = {1, 1};
  ExpectRefused(CheckPatchedImage(base, image, twice, Limits()), "changed region 1 does not follow 1");
  v1::NodeImage more = image;
  *more.add_regions() = image.regions(0);
  more.set_bytes(more.bytes() + 4096);
  ExpectRefused(CheckPatchedImage(base, more, changed, Limits()), "3 regions on a base of 2");
  v1::NodeImage unchecked = base;
  unchecked.set_bytes(4095);
  EXPECT_STATUS(CheckPatchedImage(unchecked, image, changed, Limits()),
                absl::StatusCode::kInternal);
}

TEST(PeerChecksTest, APatchedImageListsItsChangedRegionsEachChecked) {
  // Node 4's image as a patch of its second region: the image need not add up (it lists one
  // region of two), but its regions are checked and the patch names as many as it carries.
  v1::EncodeRequest request = Encode();
  std::string* changes = request.mutable_group_images(1);
  Edit(changes, [](v1::NodeImage& image) { image.mutable_regions()->DeleteSubrange(0, 1); });
  v1::ImagePatch& patch = *request.add_patches();
  patch.set_node_id(4);
  patch.add_changed(1);
  EXPECT_OK(CheckEncoding(request));
  patch.add_changed(0);
  ExpectRefused(CheckEncoding(request), "names 2 changed regions");
  patch.mutable_changed()->RemoveLast();
  Edit(changes, [](v1::NodeImage& image) { image.mutable_regions(0)->set_chunk_bytes(0); });
  ExpectRefused(CheckEncoding(request), "chunk size");
  Edit(changes, [](v1::NodeImage& image) { image.mutable_regions(0)->set_chunk_bytes(1024); });
  Edit(changes, [](v1::NodeImage& image) { image.set_bytes(kMax); });
  ExpectRefused(CheckEncoding(request), "above the");
  Edit(changes, [](v1::NodeImage& image) { image.set_bytes(8192); });
  EXPECT_OK(CheckEncoding(request));
  // Unpatched images still add up.
  Edit(request.mutable_group_images(0), [](v1::NodeImage& image) { image.set_bytes(1); });
  ExpectRefused(CheckEncoding(request), "add up");
  Edit(request.mutable_group_images(0), [](v1::NodeImage& image) { image.set_bytes(8192); });
  // An entry that is not a node image at all.
  *request.mutable_group_images(2) = "\xff";
  ExpectRefused(CheckEncoding(request), "image 2 (1 bytes) is not a node image");
  *request.mutable_group_images(2) = Image(5).SerializeAsString();
  EXPECT_OK(CheckEncoding(request));
  // Receivers of a whole or parity-only encode hold no common record to build on.
  request.set_whole(true);
  ExpectRefused(CheckEncoding(request), "whole encode comes with image patches");
  request.set_whole(false);
  request.set_parity_only(true);
  ExpectRefused(CheckEncoding(request), "parity-only encode comes with image patches");
  request.set_parity_only(false);
  for (int i = 0; i < 3; ++i) *request.add_patches() = patch;
  ExpectRefused(CheckEncoding(request), "4 image patches for a group of 3");
}

// Images are parsed into memory that held others (the images they replace): what comes out is the
// image sent, nothing of what the memory held before.
TEST(PeerChecksTest, ImagesParsedIntoReusedMemoryAreTheImagesSentAlone) {
  v1::EncodeRequest request = Encode();
  std::vector<v1::NodeImage> memory;
  for (uint32_t id : {3, 4, 5}) {
    v1::NodeImage held = Image(id, 1 << 20);  // more regions' worth of chunks, a piece, and more
    held.mutable_regions(0)->mutable_piece()->set_offset(8);
    held.add_regions()->set_region("gone");
    held.GetReflection()->MutableUnknownFields(&held)->AddVarint(99, 1);
    memory.push_back(held);
  }
  ASSERT_OK(ParseEncodeImages(request, Limits(), memory));
  ASSERT_EQ(memory.size(), 3u);
  for (int position = 0; position < 3; ++position) {
    EXPECT_EQ(memory[position].SerializeAsString(), request.group_images(position)) << position;
  }
  v1::ProposeRequest propose;
  propose.set_from_node(5);
  propose.set_step(7);
  propose.set_token(12);
  propose.set_image(Image(5).SerializeAsString());
  v1::NodeImage image = memory[0];
  ASSERT_OK(ParseProposedImage(propose, Limits(), image));
  EXPECT_EQ(image.SerializeAsString(), propose.image());
}

TEST(PeerChecksTest, AProposedPatchIsTheProposersOwnOnItsCommittedStep) {
  v1::ProposeRequest propose;
  propose.set_from_node(5);
  propose.set_step(7);
  propose.set_token(12);
  propose.set_committed_step(6);
  propose.set_image(Image(5).SerializeAsString());
  Edit(propose.mutable_image(),
       [](v1::NodeImage& image) { image.mutable_regions()->DeleteSubrange(0, 1); });
  propose.mutable_patch()->set_node_id(5);
  propose.mutable_patch()->add_changed(1);
  EXPECT_OK(CheckProposal(propose));
  propose.mutable_patch()->add_changed(0);
  ExpectRefused(CheckProposal(propose), "names 2 changed regions");
  propose.mutable_patch()->mutable_changed()->RemoveLast();
  propose.mutable_patch()->set_node_id(4);
  ExpectRefused(CheckProposal(propose), "a patch of node 4's image");
  propose.mutable_patch()->set_node_id(5);
  propose.clear_committed_step();
  ExpectRefused(CheckProposal(propose), "on no committed step");
  propose.set_committed_step(6);
  Edit(propose.mutable_image(),
       [](v1::NodeImage& image) { image.mutable_regions(0)->set_region(""); });
  ExpectRefused(CheckProposal(propose), "its name");
}

TEST(PeerChecksTest, RegionFieldsAreBounded) {
  auto with = [](auto change) {
    v1::NodeImage image = Image(1);
    change(*image.mutable_regions(1));
    return CheckNodeImage(image, Limits());
  };
  ExpectRefused(with([](v1::ImageRegion& r) { r.set_region(""); }), "its name is 0 bytes");
  ExpectRefused(with([](v1::ImageRegion& r) { r.set_region(std::string(1025, 'x')); }),
                "its name is 1025 bytes");
  ExpectRefused(with([](v1::ImageRegion& r) { r.set_dtype(std::string(65, 'f')); }), "dtype");
  ExpectRefused(with([](v1::ImageRegion& r) {
                  for (int i = 0; i <= kMaxShapeDimensions; ++i) r.add_shape(1);
                }),
                "dimensions");
  ExpectRefused(with([](v1::ImageRegion& r) { r.set_chunk_bytes(0); }), "chunk size is 0");
  ExpectRefused(with([](v1::ImageRegion& r) { r.add_chunk_crcs(9); }), "lists 5 chunk CRCs");
  ExpectRefused(with([](v1::ImageRegion& r) { r.mutable_chunk_crcs()->RemoveLast(); }),
                "lists 3 chunk CRCs");
  ExpectRefused(with([](v1::ImageRegion& r) { r.set_shape(0, -1); }), "dimension 0 is -1");
  ExpectRefused(with([](v1::ImageRegion& r) {
                  v1::RegionPiece& piece = *r.mutable_piece();
                  piece.set_replica_group("data-parallel");
                  piece.set_offset(1);
                  piece.set_region_bytes(r.bytes());
                }),
                "past the region's end");
  ExpectRefused(with([](v1::ImageRegion& r) { r.mutable_piece()->set_region_bytes(r.bytes()); }),
                "names no replica group");
  v1::NodeImage image = Image(1, 0);
  image.mutable_regions(0)->add_chunk_crcs(1);
  ExpectRefused(CheckNodeImage(image, Limits()), "empty but lists chunk CRCs");
}

TEST(PeerChecksTest, UnitListsAreBounded) {
  v1::SendUnitsRequest request;
  request.set_to_node(2);
  request.set_step(3);
  v1::UnitRef* unit = request.add_units();
  unit->set_stripe(kMax);
  unit->set_unit(2);
  ExpectRefused(CheckSendUnits(request, Limits()), "request token 0");
  request.set_request(-5);
  ExpectRefused(CheckSendUnits(request, Limits()), "request token -5");
  request.set_request(1);
  EXPECT_OK(CheckSendUnits(request, Limits()));  // the stripe is checked against the record held
  unit->set_unit(3);
  ExpectRefused(CheckSendUnits(request, Limits()), "a stripe has 3 units");
  request.clear_units();
  for (int i = 0; i <= (1 << 20); ++i) request.add_units();
  ExpectRefused(CheckSendUnits(request, Limits()), "units asked for at once");
}

TEST(PeerChecksTest, DecodeRequestsAreBounded) {
  v1::DecodeUnitsRequest request;
  request.set_to_node(2);
  request.set_step(3);
  v1::DecodeStripe* stripe = request.add_stripes();
  stripe->set_stripe(kMax);
  stripe->set_target(2);
  stripe->add_sources(0);
  stripe->add_sources(1);
  ExpectRefused(CheckDecodeUnits(request, Limits()), "request token 0");
  request.set_request(1);
  // The stripe, and whether the sources decode the target, are checked against the step held.
  EXPECT_OK(CheckDecodeUnits(request, Limits()));
  stripe->set_target(3);
  ExpectRefused(CheckDecodeUnits(request, Limits()), "unit 3 from [0, 1]: a stripe has 3 units");
  stripe->set_target(2);
  stripe->set_sources(1, 7);
  ExpectRefused(CheckDecodeUnits(request, Limits()), "unit 2 from [0, 7]: a stripe has 3 units");
  stripe->set_sources(1, 1);
  stripe->add_sources(0);
  ExpectRefused(CheckDecodeUnits(request, Limits()), "unit 2 from [0, 1, 0]");
  request.clear_stripes();
  for (int i = 0; i <= (1 << 20) / 3; ++i) request.add_stripes();
  ExpectRefused(CheckDecodeUnits(request, Limits()), "stripes asked for at once");
  request.clear_stripes();
  request.set_to_node(6);
  ExpectRefused(CheckDecodeUnits(request, Limits()), "to_node");
}

}  // namespace
}  // namespace moesnap::daemon::cluster
