// Peer request checks: bounds and consistency of every field, overflow-safe.
#include "daemon/cluster/peer_checks.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "daemon/region_limits.h"

namespace moesnap::daemon::cluster {
namespace {

constexpr int kMaxUnitsPerRequest = 1 << 20;

absl::Status CheckNode(const char* field, uint32_t id, const PeerLimits& limits) {
  if (id >= limits.node_count) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is node ", id, ", but the job has ",
                                                   limits.node_count, " nodes"));
  }
  return absl::OkStatus();
}

absl::Status CheckWait(uint32_t timeout_ms, const PeerLimits& limits) {
  if (timeout_ms > limits.commit_timeout_ms) {
    return absl::InvalidArgumentError(absl::StrCat("timeout_ms is ", timeout_ms,
                                                   ", above the job's commit timeout of ",
                                                   limits.commit_timeout_ms, " ms"));
  }
  return absl::OkStatus();
}

// What every coordinator call carries: who sends it, under which token, on which base.
absl::Status CheckCoordinatorCall(uint32_t coordinator, int64_t token, int64_t step,
                                  const std::optional<int64_t>& base, const PeerLimits& limits) {
  if (absl::Status status = CheckNode("coordinator", coordinator, limits); !status.ok()) {
    return status;
  }
  if (token <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("fencing token ", token, " is not positive"));
  }
  if (base && *base >= step) {
    return absl::InvalidArgumentError(absl::StrCat("base step ", *base, " is not before step ",
                                                   step));
  }
  return absl::OkStatus();
}

absl::Status CheckRegion(const v1::ImageRegion& region, const PeerLimits& limits) {
  auto invalid = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("region of rank ", region.rank(), ": ", what));
  };
  if (absl::Status status = CheckStoredRegion(region); !status.ok()) {
    return invalid(status.message());
  }
  if (region.bytes() > limits.max_image_bytes) {
    return invalid(absl::StrCat("it is ", region.bytes(), " bytes, above the ",
                                limits.max_image_bytes, " any image may hold"));
  }
  return absl::OkStatus();
}

absl::Status CheckRequestToken(int64_t request) {
  if (request <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request token ", request, ": a request names the asking node's token, which is positive"));
  }
  return absl::OkStatus();
}

absl::Status InvalidImage(const v1::NodeImage& image, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("image of node ", image.node_id(), ": ", what));
}

// The fields of `image` around its regions.
absl::Status CheckImageHead(const v1::NodeImage& image, const PeerLimits& limits) {
  if (absl::Status status = CheckNode("the image's node", image.node_id(), limits); !status.ok()) {
    return status;
  }
  if (image.bytes() > limits.max_image_bytes) {
    return InvalidImage(image, absl::StrCat(image.bytes(), " bytes, above the ",
                                            limits.max_image_bytes,
                                            " this node's pool could hold parity for"));
  }
  if (image.ranks_size() > PeerLimits::kMaxRanksPerImage) {
    return InvalidImage(image, absl::StrCat(image.ranks_size(), " ranks, above ",
                                            PeerLimits::kMaxRanksPerImage));
  }
  return absl::OkStatus();
}

// Region `region` of `image`, valid.
absl::Status CheckImageRegion(const v1::NodeImage& image, const v1::ImageRegion& region,
                              const PeerLimits& limits) {
  absl::Status status = CheckRegion(region, limits);
  return status.ok() ? status : InvalidImage(image, status.message());
}

// `total`, the sum of an image's regions' sizes added to as it is walked, plus `bytes`: no longer
// added to once past the image's bytes, so that it cannot wrap (the image and each region are at
// most max_image_bytes, checked first).
void AddRegionBytes(const v1::NodeImage& image, uint64_t bytes, uint64_t& total) {
  if (total <= image.bytes()) total += bytes;
}

// That the sum of `image`'s regions' sizes is its bytes.
absl::Status CheckImageSum(const v1::NodeImage& image, uint64_t total) {
  if (total == image.bytes()) return absl::OkStatus();
  return InvalidImage(image, absl::StrCat("its regions add up to ",
                                          total > image.bytes() ? "more than " : "", total,
                                          " bytes, not the ", image.bytes(), " it says"));
}

// Every field of `image`, and the sum of its regions' sizes (which a patch's image, listing only
// the regions it changed, need not match).
absl::StatusOr<uint64_t> CheckImageFields(const v1::NodeImage& image, const PeerLimits& limits) {
  if (absl::Status status = CheckImageHead(image, limits); !status.ok()) return status;
  uint64_t total = 0;
  for (const v1::ImageRegion& region : image.regions()) {
    if (absl::Status status = CheckImageRegion(image, region, limits); !status.ok()) {
      return status;
    }
    AddRegionBytes(image, region.bytes(), total);
  }
  return total;
}

// `bytes`, a NodeImage serialized, parsed into `image` (its memory reused).
absl::Status ParseImage(const std::string& bytes, const std::string& what, v1::NodeImage& image) {
  if (!image.ParseFromString(bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " (", bytes.size(),
                                                   " bytes) is not a node image"));
  }
  return absl::OkStatus();
}

// The changes a patch carries: each region valid, as many as the patch names. The image the patch
// builds is checked once built: at its changed regions by a participant (GroupImagesOf), whole by
// the coordinator (Coordinator::RunRound).
absl::Status CheckChanges(const v1::NodeImage& changes, const v1::ImagePatch& patch,
                          const PeerLimits& limits) {
  if (absl::Status status = CheckImageFields(changes, limits).status(); !status.ok()) {
    return status;
  }
  if (patch.changed_size() != changes.regions_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the patch of node ", patch.node_id(), "'s image names ", patch.changed_size(),
        " changed regions and its image carries ", changes.regions_size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckImageMember(const v1::NodeImage& image, size_t position, uint32_t member) {
  if (image.node_id() == member) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("image ", position, " is node ", image.node_id(),
                                                 "'s, not node ", member, "'s"));
}

absl::Status CheckNodeImage(const v1::NodeImage& image, const PeerLimits& limits) {
  absl::StatusOr<uint64_t> total = CheckImageFields(image, limits);
  if (!total.ok()) return total.status();
  return CheckImageSum(image, *total);
}

absl::Status CheckPatchedImage(const v1::NodeImage& base, const v1::NodeImage& image,
                               absl::Span<const uint32_t> changed, const PeerLimits& limits) {
  if (absl::Status status = CheckImageHead(image, limits); !status.ok()) return status;
  if (image.regions_size() != base.regions_size()) {
    return InvalidImage(image, absl::StrCat(image.regions_size(), " regions on a base of ",
                                            base.regions_size()));
  }
  int64_t previous = -1;
  for (uint32_t position : changed) {
    if (static_cast<int64_t>(position) <= previous ||
        position >= static_cast<uint32_t>(image.regions_size())) {
      return InvalidImage(image, absl::StrCat("changed region ", position, " does not follow ",
                                              previous, " within its ", image.regions_size(),
                                              " regions"));
    }
    previous = position;
  }
  // The base's regions add up to its bytes (it was checked): without the changed ones, to this.
  uint64_t total = base.bytes();
  for (uint32_t position : changed) {
    const uint64_t was = base.regions(static_cast<int>(position)).bytes();
    if (was > total) {
      return absl::InternalError(absl::StrCat("the base image of node ", base.node_id(),
                                              " holds more in its regions than its ", base.bytes(),
                                              " bytes: it was never checked"));
    }
    total -= was;
  }
  for (uint32_t position : changed) {
    const v1::ImageRegion& region = image.regions(static_cast<int>(position));
    if (absl::Status status = CheckImageRegion(image, region, limits); !status.ok()) {
      return status;
    }
    AddRegionBytes(image, region.bytes(), total);
  }
  return CheckImageSum(image, total);
}

absl::Status CheckGroupRecord(const v1::JournalCluster& record,
                              const std::vector<uint32_t>& group_ids, const PeerLimits& limits) {
  // A committed step is the group's images of it: none is a record of nothing.
  if (record.has_committed_step() || record.group_images_size() > 0) {
    if (absl::Status status = CheckGroupImages(record.group_images(), group_ids, limits);
        !status.ok()) {
      return status;
    }
  }
  for (const v1::JournalParity& parity : record.parity()) {
    if (parity.bytes() > limits.unit_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("parity of stripe ", parity.stripe(), " is ",
                                                     parity.bytes(), " bytes, above the unit of ",
                                                     limits.unit_bytes));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPropose(const v1::ProposeRequest& request, const PeerLimits& limits) {
  if (absl::Status status = CheckNode("from_node", request.from_node(), limits); !status.ok()) {
    return status;
  }
  if (!request.has_image()) return absl::OkStatus();
  if (request.token() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a proposal with an image names the token it was opened under; ", request.token(),
        " is not positive"));
  }
  if (request.has_committed_step() && request.committed_step() >= request.step()) {
    return absl::InvalidArgumentError(absl::StrCat("committed step ", request.committed_step(),
                                                   " is not before step ", request.step()));
  }
  if (request.has_patch() &&
      (!request.has_committed_step() || request.patch().node_id() != request.from_node())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node ", request.from_node(), " proposes a patch of node ", request.patch().node_id(),
        "'s image", request.has_committed_step() ? "" : " on no committed step"));
  }
  return absl::OkStatus();
}

absl::Status ParseProposedImage(const v1::ProposeRequest& request, const PeerLimits& limits,
                                v1::NodeImage& image) {
  if (absl::Status status = ParseImage(request.image(), "the proposed image", image);
      !status.ok()) {
    return status;
  }
  if (image.node_id() != request.from_node() || image.step() != request.step()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node ", request.from_node(), " proposes step ", request.step(), " with the image of node ",
        image.node_id(), "'s step ", image.step()));
  }
  if (!request.has_patch()) return CheckNodeImage(image, limits);
  return CheckChanges(image, request.patch(), limits);
}

absl::Status CheckPrepare(const v1::PrepareRequest& request, const PeerLimits& limits) {
  const std::optional<int64_t> base =
      request.has_base_step() ? std::optional<int64_t>(request.base_step()) : std::nullopt;
  if (absl::Status status = CheckCoordinatorCall(request.coordinator(), request.token(),
                                                 request.step(), base, limits);
      !status.ok()) {
    return status;
  }
  return CheckWait(request.timeout_ms(), limits);
}

absl::Status CheckPrepareAnswer(const v1::PrepareResponse& response, uint32_t node, int64_t step,
                                const PeerLimits& limits) {
  auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("node ", node, " answered its Prepare of step ", step, " with ", what));
  };
  if (response.has_committed_step() && response.committed_step() >= step) {
    return invalid(absl::StrCat("committed step ", response.committed_step(),
                                ", not before the step"));
  }
  if (response.image().node_id() != node) {
    return invalid(absl::StrCat("the image of node ", response.image().node_id()));
  }
  if (response.rebuilding()) {
    if (response.image().regions_size() != 0 || response.image().bytes() != 0) {
      return invalid("an image of its data, yet it rebuilds (absent from the step)");
    }
    return absl::OkStatus();
  }
  if (response.receiver()) return invalid("itself as a parity receiver, yet it does not rebuild");
  if (response.image().step() != step) {
    return invalid(absl::StrCat("its image of step ", response.image().step()));
  }
  PeerLimits any_group = limits;
  any_group.max_image_bytes = PeerLimits::kMaxAnyImageBytes;
  absl::Status image = CheckNodeImage(response.image(), any_group);
  return image.ok() ? image : invalid(absl::StrCat("an invalid image: ", image.message()));
}

absl::Status CheckEncode(const v1::EncodeRequest& request, const PeerLimits& limits) {
  const std::optional<int64_t> base =
      request.has_base_step() ? std::optional<int64_t>(request.base_step()) : std::nullopt;
  if (absl::Status status = CheckCoordinatorCall(request.coordinator(), request.token(),
                                                 request.step(), base, limits);
      !status.ok()) {
    return status;
  }
  if (absl::Status status = CheckWait(request.timeout_ms(), limits); !status.ok()) return status;
  if (request.group_images_size() != limits.group_size) {
    return absl::InvalidArgumentError(absl::StrCat(request.group_images_size(),
                                                   " images for a group of ", limits.group_size));
  }
  if (request.patches_size() > request.group_images_size()) {
    return absl::InvalidArgumentError(absl::StrCat(request.patches_size(),
                                                   " image patches for a group of ",
                                                   request.group_images_size()));
  }
  if (request.patches_size() > 0 && (request.whole() || request.parity_only())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a ", request.whole() ? "whole" : "parity-only", " encode comes with image patches"));
  }
  return absl::OkStatus();
}

absl::Status ParseEncodeImages(const v1::EncodeRequest& request, const PeerLimits& limits,
                               std::vector<v1::NodeImage>& images) {
  images.resize(request.group_images_size());
  for (int position = 0; position < request.group_images_size(); ++position) {
    v1::NodeImage& image = images[position];
    if (absl::Status status = ParseImage(request.group_images(position),
                                         absl::StrCat("image ", position), image);
        !status.ok()) {
      return status;
    }
    const auto patch =
        std::find_if(request.patches().begin(), request.patches().end(),
                     [&](const v1::ImagePatch& each) { return each.node_id() == image.node_id(); });
    if (absl::Status status = patch == request.patches().end()
                                  ? CheckNodeImage(image, limits)
                                  : CheckChanges(image, *patch, limits);
        !status.ok()) {
      return status;
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSendUnits(const v1::SendUnitsRequest& request, const PeerLimits& limits) {
  if (absl::Status status = CheckNode("to_node", request.to_node(), limits); !status.ok()) {
    return status;
  }
  if (absl::Status status = CheckRequestToken(request.request()); !status.ok()) return status;
  if (request.units_size() > kMaxUnitsPerRequest) {
    return absl::InvalidArgumentError(absl::StrCat(request.units_size(),
                                                   " units asked for at once, above ",
                                                   kMaxUnitsPerRequest));
  }
  for (const v1::UnitRef& unit : request.units()) {
    if (unit.unit() >= static_cast<uint32_t>(limits.group_size)) {
      return absl::InvalidArgumentError(absl::StrCat("unit ", unit.unit(), " of stripe ",
                                                     unit.stripe(), ": a stripe has ",
                                                     limits.group_size, " units"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDecodeUnits(const v1::DecodeUnitsRequest& request, const PeerLimits& limits) {
  if (absl::Status status = CheckNode("to_node", request.to_node(), limits); !status.ok()) {
    return status;
  }
  if (absl::Status status = CheckRequestToken(request.request()); !status.ok()) return status;
  if (request.stripes_size() > kMaxUnitsPerRequest / limits.group_size) {
    return absl::InvalidArgumentError(absl::StrCat(request.stripes_size(),
                                                   " stripes asked for at once, above ",
                                                   kMaxUnitsPerRequest / limits.group_size));
  }
  const uint32_t units = static_cast<uint32_t>(limits.group_size);
  for (const v1::DecodeStripe& stripe : request.stripes()) {
    const bool within = stripe.target() < units && stripe.sources_size() < limits.group_size &&
                        std::all_of(stripe.sources().begin(), stripe.sources().end(),
                                    [units](uint32_t unit) { return unit < units; });
    if (!within) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stripe ", stripe.stripe(), ": unit ", stripe.target(), " from [",
          absl::StrJoin(stripe.sources(), ", "), "]: a stripe has ", limits.group_size, " units"));
    }
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon::cluster
