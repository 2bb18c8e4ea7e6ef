// Fuzzes the checks of Peer requests, and of a trainer's region registrations (Agent), with
// protobuf-parsed input: the first byte picks the request type, the rest is its wire encoding. A
// request the checks pass is then used the way the daemon uses it (an Encode's images parsed and
// built on a record of the base step, stripe arithmetic over their sizes, the delta layout of two
// images), which must stay in bounds: anything the checks let through is safe to act on.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "daemon/cluster/context.h"
#include "daemon/cluster/encode_images.h"
#include "daemon/cluster/image_patch.h"
#include "daemon/cluster/peer_checks.h"
#include "daemon/node_image.h"
#include "daemon/region_limits.h"
#include "daemon/step_changes.h"
#include "erasure/stripe_layout.h"
#include "proto/moesnap.pb.h"
#include "tests/fuzz/proto_input.h"

namespace {

using namespace moesnap::daemon;
using namespace moesnap::daemon::cluster;
using moesnap::fuzz::Parse;
namespace v1 = moesnap::v1;

constexpr int kDataUnits = 2;
constexpr int kParityUnits = 1;
constexpr uint64_t kUnitBytes = 4096;

const PeerLimits& Limits() {
  static const PeerLimits limits{.node_count = 6, .group_size = kDataUnits + kParityUnits,
                                 .unit_bytes = kUnitBytes, .commit_timeout_ms = 60000,
                                 .max_image_bytes = uint64_t{3} << 20};
  return limits;
}

const moesnap::erasure::StripeLayout& Layout() {
  static const moesnap::erasure::StripeLayout layout =
      *moesnap::erasure::StripeLayout::Create(kDataUnits, kParityUnits, kUnitBytes);
  return layout;
}

// Node 1's view of a job of 6 nodes in groups of (2,1), checked against Limits().
const Topology& NodeOne() {
  static const std::unique_ptr<const Topology> topology = [] {
    ClusterOptions options;
    options.job = "fuzz";
    options.node_count = 6;
    options.data_units = kDataUnits;
    options.parity_units = kParityUnits;
    options.stripe_unit_bytes = kUnitBytes;
    options.commit_timeout_ms = Limits().commit_timeout_ms;
    options.advertise_host = "127.0.0.1";
    options.tls.insecure = true;
    return *Topology::Create(1, options, Limits().max_image_bytes / Limits().group_size);
  }();
  return *topology;
}

// Node 1's record of its group (nodes 0, 1, 2) at step 6, each image two regions of 4 KiB, with
// its images' bytes: what patched and absent members are built from.
const ClusterStore::RecordWithBytes& BaseRecord() {
  static const ClusterStore::RecordWithBytes held = [] {
    auto record = std::make_shared<v1::JournalCluster>();
    auto bytes = std::make_shared<std::vector<std::string>>();
    record->set_committed_step(6);
    for (uint32_t id : {0, 1, 2}) {
      v1::NodeImage& image = *record->add_group_images();
      image.set_node_id(id);
      image.set_step(6);
      for (const char* name : {"a", "b"}) {
        v1::ImageRegion& region = *image.add_regions();
        region.set_rank(id);
        region.set_region(name);
        region.set_step(6);
        region.set_bytes(4096);
        region.set_dtype("float32");
        region.set_chunk_bytes(4096);
        region.add_chunk_crcs(id);
      }
      image.set_bytes(8192);
      bytes->push_back(ImageBytes(image));
    }
    return ClusterStore::RecordWithBytes{std::move(record), std::move(bytes)};
  }();
  return held;
}

// What Encode and a rebuild do with a group's images once they are checked.
// `images`: a RepeatedPtrField or a std::vector of them.
template <typename Images>
void UseGroup(const Images& images) {
  std::vector<uint64_t> sizes;
  for (const v1::NodeImage& image : images) sizes.push_back(image.bytes());
  const uint64_t stripes = Layout().StripeCount(sizes);
  for (uint64_t stripe = 0; stripe < stripes; ++stripe) {
    if (Layout().ParityLength(stripe, sizes) > kUnitBytes) std::abort();
  }
  std::vector<std::vector<bool>> units;
  for (int position = 0; position < static_cast<int>(images.size()); ++position) {
    const v1::NodeImage& before = images[position > 0 ? position - 1 : position];
    units.push_back(ChangedUnits(before, images[position], kUnitBytes)
                        .value_or(std::vector<bool>(Layout().UnitCount(images[position].bytes()),
                                                    true)));
    if (units.back().size() != Layout().UnitCount(images[position].bytes())) std::abort();
  }
  if (static_cast<int>(units.size()) == Layout().group_size()) {
    const StepChanges changes = ChangesOf(Layout(), std::move(units), sizes, {});
    if (changes.fresh_stripes.size() != stripes) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t kind = data[0] % 8;
  ++data;
  --size;
  switch (kind) {
    case 0: {
      v1::ProposeRequest request;
      v1::NodeImage image;
      if (Parse(data, size, &request) && CheckPropose(request, Limits()).ok() &&
          request.has_image()) {
        (void)ParseProposedImage(request, Limits(), image);
      }
      break;
    }
    case 1: {
      v1::PrepareRequest request;
      if (Parse(data, size, &request) && CheckPrepare(request, Limits()).ok()) {
        if (request.timeout_ms() > Limits().commit_timeout_ms) std::abort();
      }
      break;
    }
    case 2: {
      v1::EncodeRequest request;
      if (!Parse(data, size, &request) || !CheckEncode(request, Limits()).ok()) break;
      // As a participant takes it: the absent members, the images parsed into a replaced
      // record's memory (given back when refused), the step's images built on its record. The
      // replaced record is a copy of it, known to be: each image built in its memory is copied
      // by its fields on top alone.
      const absl::StatusOr<std::set<int>> absent = AbsentPositions(request, NodeOne());
      if (!absent.ok()) break;
      SentImages sent = ParsedImages(
          request, NodeOne(), *absent,
          {.record = std::make_shared<v1::JournalCluster>(*BaseRecord().record),
           .base_of = BaseRecord().record,
           .differs_at = {{0, {}}, {1, {}}, {2, {}}}});
      if (!sent.status.ok()) {
        if (std::move(sent).Unused().record->group_images_size() != 3) std::abort();
        break;
      }
      // An image copied into memory that held another, either way round, is the copy alone.
      for (int position = 0; position < 3; ++position) {
        const v1::NodeImage& base = BaseRecord().record->group_images(position);
        const v1::NodeImage& parsed = sent.images[position];
        v1::NodeImage memory = parsed;
        AssignImage(base, memory);
        if (ImageBytes(memory) != ImageBytes(base)) std::abort();
        memory = base;
        AssignImage(parsed, memory);
        if (ImageBytes(memory) != ImageBytes(parsed)) std::abort();
      }
      absl::StatusOr<GroupImages> built =
          GroupImagesOf(request, NodeOne(), BaseRecord(), *absent, std::move(sent));
      if (!built.ok()) break;
      UseGroup(built->images);
      // Every image it takes is valid, a patched one checked at its changed regions alone.
      for (const v1::NodeImage& image : built->images) {
        if (!CheckNodeImage(image, NodeOne().limits).ok()) std::abort();
      }
      for (const auto& [position, regions] : built->changed_regions) {
        const v1::NodeImage& before = BaseRecord().record->group_images(position);
        const v1::NodeImage& image = built->images[position];
        // An image built on its base: its changed units, found from its changed regions, are the
        // whole walk's; its bytes are its serialization.
        if (ChangedUnitsAt(before, image, regions, kUnitBytes) !=
                ChangedUnits(before, image, kUnitBytes) ||
            built->bytes[position] != ImageBytes(image)) {
          std::abort();
        }
        // It is its base but at its changed regions (and on top): copied into the base's image
        // by those regions alone, as the next step copies it, it is the copy whole.
        if (!built->unknown_fields.contains(position)) {
          ImageMemory memory{.image = before, .differs_at = regions};
          AssignImage(image, memory);
          if (ImageBytes(memory.image) != ImageBytes(image)) std::abort();
        }
      }
      break;
    }
    case 3: {
      v1::SendUnitsRequest request;
      if (Parse(data, size, &request) && CheckSendUnits(request, Limits()).ok()) {
        for (const v1::UnitRef& unit : request.units()) {
          if (unit.unit() >= static_cast<uint32_t>(Limits().group_size)) std::abort();
        }
      }
      break;
    }
    case 4: {
      v1::DecodeUnitsRequest request;
      if (Parse(data, size, &request) && CheckDecodeUnits(request, Limits()).ok()) {
        const uint32_t units = static_cast<uint32_t>(Limits().group_size);
        for (const v1::DecodeStripe& stripe : request.stripes()) {
          if (stripe.target() >= units || stripe.sources_size() >= Limits().group_size) std::abort();
          for (uint32_t source : stripe.sources()) {
            if (source >= units) std::abort();
          }
        }
      }
      break;
    }
    case 5: {
      // A group record another node answered (GroupState, LocateRank).
      v1::JournalCluster record;
      if (Parse(data, size, &record) && CheckGroupRecord(record, {3, 4, 5}, Limits()).ok() &&
          record.group_images_size() > 0) {
        UseGroup(record.group_images());
      }
      break;
    }
    case 6: {
      v1::RegisterRegionsRequest request;
      if (Parse(data, size, &request)) {
        for (const v1::RegionSpec& spec : request.regions()) (void)CheckRegionSpec(spec);
      }
      break;
    }
    default: {  // 7
      v1::NodeImage image;
      if (Parse(data, size, &image) && CheckNodeImage(image, Limits()).ok()) {
        google::protobuf::RepeatedPtrField<v1::NodeImage> group;
        for (int position = 0; position < Limits().group_size; ++position) *group.Add() = image;
        UseGroup(group);
      }
      break;
    }
  }
  return 0;
}
