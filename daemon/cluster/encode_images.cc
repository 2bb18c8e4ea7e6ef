// What an Encode carries of its group's images: the absent members it names, each member's image
// parsed and checked, and the step's images built from them.
#include "daemon/cluster/encode_images.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/cluster/image_patch.h"
#include "daemon/cluster/peer_checks.h"

namespace moesnap::daemon::cluster {
namespace {

// Where node `id` stands in `group`; none when it is not a member.
std::optional<int> PositionIn(const std::vector<uint32_t>& group, uint32_t id) {
  const auto found = std::find(group.begin(), group.end(), id);
  if (found == group.end()) return std::nullopt;
  return static_cast<int>(found - group.begin());
}

}  // namespace

absl::StatusOr<std::set<int>> AbsentPositions(const v1::EncodeRequest& request,
                                              const Topology& topology) {
  const std::vector<uint32_t>& group = topology.groups[topology.group];
  std::set<int> positions;
  for (uint32_t id : request.absent_nodes()) {
    const std::optional<int> position = PositionIn(group, id);
    if (!position || (id == topology.node_id && !request.parity_only())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", request.step(), ": absent node ", id, " is ",
          id == topology.node_id ? "this node, which was asked to encode"
                                 : absl::StrCat("not in group ", topology.group)));
    }
    v1::NodeImage placeholder;
    if (!positions.insert(*position).second ||
        !placeholder.ParseFromString(request.group_images(*position)) ||
        placeholder.node_id() != id || placeholder.bytes() != 0 ||
        placeholder.regions_size() != 0 || placeholder.ranks_size() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", request.step(), ": absent node ", id,
          " is listed twice or its entry is not a placeholder naming it alone"));
    }
  }
  for (uint32_t id : request.parity_receivers()) {
    if (std::find(request.absent_nodes().begin(), request.absent_nodes().end(), id) ==
        request.absent_nodes().end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", request.step(), ": parity receiver ", id, " is not named absent"));
    }
  }
  if (request.parity_only() && !positions.contains(topology.position)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", request.step(), ": node ", topology.node_id,
        " is asked for parity only and is not named absent"));
  }
  if (positions.size() > static_cast<size_t>(topology.options.parity_units)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", request.step(), ": ", positions.size(), " absent nodes in a group, more than m = ",
        topology.options.parity_units));
  }
  return positions;
}

SentImages ParsedImages(const v1::EncodeRequest& request, const Topology& topology,
                        const std::set<int>& absent, SpareRecord spare) {
  const std::vector<uint32_t>& group = topology.groups[topology.group];
  SentImages sent;
  sent.spare = std::move(spare);
  for (const v1::ImagePatch& patch : request.patches()) {
    const std::optional<int> position = PositionIn(group, patch.node_id());
    if (!position || absent.contains(*position) ||
        !sent.patches.emplace(*position, &patch).second) {
      sent.status = absl::InvalidArgumentError(absl::StrCat(
          "step ", request.step(), ": the patch of node ", patch.node_id(),
          " is for a node not in group ", topology.group, ", an absent one, or one patched twice"));
      return sent;
    }
  }
  sent.images.resize(group.size());
  for (int position = 0; position < static_cast<int>(group.size()); ++position) {
    if (!request.parity_only() && !absent.contains(position) && !sent.patches.contains(position) &&
        sent.spare.record && position < sent.spare.record->group_images_size()) {
      sent.images[position] = sent.spare.Memory(position, nullptr).image;
      sent.parsed_in_spare.push_back(position);
    }
  }
  sent.status = ParseEncodeImages(request, topology.limits, sent.images);
  if (!sent.status.ok()) {
    sent.status = absl::InvalidArgumentError(
        absl::StrCat("step ", request.step(), ": ", sent.status.message()));
  }
  return sent;
}

ImageMemory SpareRecord::Memory(int position,
                                const std::shared_ptr<const v1::JournalCluster>& committed) {
  ImageMemory memory;
  if (record && position < record->group_images_size()) {
    memory.image.Swap(record->mutable_group_images(position));
  }
  if (auto known = differs_at.extract(position); known && IsRecord(base_of, committed)) {
    memory.differs_at = std::move(known.mapped());
  }
  return memory;
}

bool IsRecord(const std::weak_ptr<const v1::JournalCluster>& taken,
              const std::shared_ptr<const v1::JournalCluster>& record) {
  return record != nullptr && !taken.owner_before(record) && !record.owner_before(taken);
}

SpareRecord SentImages::Unused() && {
  for (int position : parsed_in_spare) {
    if (position < static_cast<int>(images.size())) {
      images[position].Swap(spare.record->mutable_group_images(position));
    }
  }
  return std::move(spare);
}

absl::StatusOr<GroupImages> GroupImagesOf(const v1::EncodeRequest& request,
                                          const Topology& topology,
                                          const ClusterStore::RecordWithBytes& record,
                                          const std::set<int>& absent, SentImages sent) {
  const v1::JournalCluster& committed = *record.record;
  const std::vector<uint32_t>& group = topology.groups[topology.group];
  const int64_t step = request.step();
  const std::map<int, const v1::ImagePatch*>& patches = sent.patches;
  // Absent members' images and patched ones' regions come from the record of the base step.
  if (!absent.empty() || !patches.empty()) {
    if (!committed.has_committed_step() || !request.has_base_step() ||
        committed.committed_step() != request.base_step() ||
        committed.group_images_size() != static_cast<int>(group.size())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step, " is ", absent.empty() ? "sent as patches" : "degraded", ", and node ",
          topology.node_id, " holds no committed record of its group at the base step to take ",
          absent.empty() ? "the images' other regions" : "the absent nodes' images", " from"));
    }
  }
  // Each image is built in the memory of a replaced record's, when one is spare.
  auto memory = [&](int position) { return sent.spare.Memory(position, record.record); };
  GroupImages images;
  images.images.reserve(group.size());
  images.bytes.resize(group.size());
  images.base = record.record;
  for (int position = 0; position < static_cast<int>(group.size()); ++position) {
    std::string& bytes = images.bytes[position];
    if (absent.contains(position)) {
      // Frozen at its last committed image, which every live member's record holds alike.
      ImageMemory frozen = memory(position);
      if (AssignImage(committed.group_images(position), frozen)) {
        images.unknown_fields.insert(position);
      }
      images.images.push_back(std::move(frozen.image));
      images.changed_regions[position] = {};
      if (const std::string_view kept = record.ImageBytesOf(position); !kept.empty()) {
        bytes.assign(kept);
      } else {
        ImageBytesInto(images.images.back(), bytes);
      }
    } else if (auto patch = patches.find(position); patch != patches.end()) {
      bool unknown_fields = false;
      absl::StatusOr<v1::NodeImage> image = PatchedImage(
          committed.group_images(position), record.ImageBytesOf(position), sent.images[position],
          *patch->second, bytes, memory(position), &unknown_fields);
      if (!image.ok()) {
        return absl::Status(image.status().code(),
                            absl::StrCat("step ", step, ": ", image.status().message()));
      }
      images.images.push_back(*std::move(image));
      images.changed_regions[position].assign(patch->second->changed().begin(),
                                              patch->second->changed().end());
      if (unknown_fields) images.unknown_fields.insert(position);
    } else {
      // Its bytes are the coordinator's serialization, which the record journals and a later
      // patch's image is spliced from: a coordinator that sent another serialization of the same
      // image fails the CRC check of its later patches here, and the journal still parses to it.
      images.images.push_back(std::move(sent.images[position]));
      bytes = request.group_images(position);
    }
  }
  // Each image is its member's and valid: one sent whole was checked as it was parsed
  // (ParseEncodeImages), the others, built on the record's, are checked as built at the regions
  // they changed, for the record's images were checked (ClusterStore::ClusterRecord).
  for (int position = 0; position < static_cast<int>(group.size()); ++position) {
    const v1::NodeImage& image = images.images[position];
    absl::Status status = CheckImageMember(image, position, group[position]);
    const auto changed = images.changed_regions.find(position);
    if (status.ok() && changed != images.changed_regions.end()) {
      status = CheckPatchedImage(committed.group_images(position), image, changed->second,
                                 topology.limits);
    }
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("step ", step, ": ", status.message()));
    }
  }
  return images;
}

}  // namespace moesnap::daemon::cluster
