// Fuzzes the checks of Peer requests, and of a trainer's region registrations (Agent), with
// protobuf-parsed input: the first byte picks the request type, the rest is its wire encoding. A request the checks pass is then used the way the daemon
// uses it (stripe arithmetic over the images' sizes, the delta layout of two images), which must
// stay in bounds: anything the checks let through is safe to act on.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

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

// What Encode and a rebuild do with a group's images once they are checked.
void UseGroup(const std::vector<v1::NodeImage>& images) {
  std::vector<uint64_t> sizes;
  for (const v1::NodeImage& image : images) sizes.push_back(image.bytes());
  const uint64_t stripes = Layout().StripeCount(sizes);
  for (uint64_t stripe = 0; stripe < stripes; ++stripe) {
    if (Layout().ParityLength(stripe, sizes) > kUnitBytes) std::abort();
  }
  std::vector<std::vector<bool>> units;
  for (int position = 0; position < images.size(); ++position) {
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
      std::vector<v1::NodeImage> images;
      if (Parse(data, size, &request) && CheckEncode(request, Limits()).ok() &&
          ParseEncodeImages(request, Limits(), images).ok()) {
        UseGroup(images);
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
