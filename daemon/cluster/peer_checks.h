// Checks of everything a peer sends, before any unit acts on it: every field of every Peer request,
// and the node images and group records peers hand over (in Encode, and in the answers a Prepare, a
// rebuild or an elastic restore works from). Each check bounds what is allocated, looped over or
// waited for, and is overflow-safe; an error names the field and what was expected. What only a
// unit's own state can judge (a fencing token against the leader etcd names, a proposed step
// against what this node captured, a unit against the committed record) is checked by that unit.
#ifndef MOESNAP_DAEMON_CLUSTER_PEER_CHECKS_H_
#define MOESNAP_DAEMON_CLUSTER_PEER_CHECKS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

// What a request is checked against: the job's shape and this node's part in it.
struct PeerLimits {
  uint32_t node_count = 0;
  int group_size = 0;     // k + m
  uint64_t unit_bytes = 0;
  uint32_t commit_timeout_ms = 0;  // the longest a coordinator may ask a node to wait
  // The largest image any member may hold: more data than this would need more parity than this
  // node's pool can hold (pool bytes x group size), so it is refused before anything is sized by it.
  uint64_t max_image_bytes = 0;

  // Names, dtypes and shapes are bounded as a trainer's registration is (region_limits.h).
  static constexpr int kMaxRanksPerImage = 1 << 16;
  // The largest image checked for its structure alone, where this node's pool does not bound it
  // (another group's image, which its members check against their own pools): sizes summed below
  // it cannot wrap.
  static constexpr uint64_t kMaxAnyImageBytes = uint64_t{1} << 62;
};

// One node's image: regions back to back whose sizes add up to `bytes` without overflow, each
// region's chunk CRCs matching its size and chunk size, names, dtypes and shapes bounded.
absl::Status CheckNodeImage(const v1::NodeImage& image, const PeerLimits& limits);
// CheckNodeImage of `image`, which is `base` but for its regions at `changed` (ascending, within
// both) and its fields around the regions, as PatchedImage builds it, where `base` passed
// CheckNodeImage: the fields, the changed regions and the sum of the sizes, which differs from
// the base's only at them. A step of a few changed regions among thousands checks those few.
absl::Status CheckPatchedImage(const v1::NodeImage& base, const v1::NodeImage& image,
                               absl::Span<const uint32_t> changed, const PeerLimits& limits);
// That the image at `position` of a group's images is `member`'s.
absl::Status CheckImageMember(const v1::NodeImage& image, size_t position, uint32_t member);
// A group's images by position (a RepeatedPtrField or a std::vector of them): one per position of
// `group_ids`, each of that node, each valid.
template <typename Images>
absl::Status CheckGroupImages(const Images& images, const std::vector<uint32_t>& group_ids,
                              const PeerLimits& limits) {
  if (static_cast<size_t>(images.size()) != group_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat(images.size(), " images for a group of ",
                                                   group_ids.size()));
  }
  for (size_t position = 0; position < group_ids.size(); ++position) {
    const v1::NodeImage& image = images[static_cast<int>(position)];
    if (absl::Status status = CheckImageMember(image, position, group_ids[position]);
        !status.ok()) {
      return status;
    }
    if (absl::Status status = CheckNodeImage(image, limits); !status.ok()) return status;
  }
  return absl::OkStatus();
}
// A group record another node holds (GroupState, LocateRank): no committed step and no images, or
// a committed step and a full group of `group_ids`, each valid; its parity units' sizes within a
// unit.
absl::Status CheckGroupRecord(const v1::JournalCluster& record,
                              const std::vector<uint32_t>& group_ids, const PeerLimits& limits);

// Every field of a proposal but what its image holds (ParseProposedImage checks that).
absl::Status CheckPropose(const v1::ProposeRequest& request, const PeerLimits& limits);
// The image of a proposal that passed CheckPropose, parsed into `image` (its memory reused) and
// checked: the proposer's own, of the step; whole, a valid image (CheckNodeImage); as a patch,
// its changed regions each valid and as many as the patch names. The image the patch builds is
// checked once built, by whoever builds it (CheckNodeImage, or CheckPatchedImage on a checked
// base).
absl::Status ParseProposedImage(const v1::ProposeRequest& request, const PeerLimits& limits,
                                v1::NodeImage& image);
absl::Status CheckPrepare(const v1::PrepareRequest& request, const PeerLimits& limits);
// The answer of `node` to the coordinator's Prepare of `step`: its committed step before the step;
// rebuilding, an image of its id alone; otherwise its own valid image of the step (CheckNodeImage,
// its size bounded by kMaxAnyImageBytes: the node may be of another group, with larger pools).
absl::Status CheckPrepareAnswer(const v1::PrepareResponse& response, uint32_t node, int64_t step,
                                const PeerLimits& limits);
// Every field of an Encode but what its images hold (ParseEncodeImages checks that).
absl::Status CheckEncode(const v1::EncodeRequest& request, const PeerLimits& limits);
// The images of an Encode that passed CheckEncode, each parsed into `images[position]` (resized to
// the group; the memory of those there is reused) and checked: one without a patch a valid image
// (CheckNodeImage), a patched one's changed regions each valid and as many as its patch names.
absl::Status ParseEncodeImages(const v1::EncodeRequest& request, const PeerLimits& limits,
                               std::vector<v1::NodeImage>& images);
absl::Status CheckSendUnits(const v1::SendUnitsRequest& request, const PeerLimits& limits);
// Stripes bounded in number, each unit index within a stripe (the helper checks the rest against
// the step it holds).
absl::Status CheckDecodeUnits(const v1::DecodeUnitsRequest& request, const PeerLimits& limits);

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_PEER_CHECKS_H_
