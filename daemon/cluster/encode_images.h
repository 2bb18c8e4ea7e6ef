// What an Encode carries of its group's images. The coordinator sends each member's image as its
// bytes (whole, as its changes since the base step with an ImagePatch, or, for an absent member,
// a placeholder naming it); a receiver parses each into the memory of the image it replaces, so a
// step of thousands of regions per node allocates no entry anew, checks them before anything acts
// on the request, and builds the step's images from them and its record of the base step.
#ifndef MOESNAP_DAEMON_CLUSTER_ENCODE_IMAGES_H_
#define MOESNAP_DAEMON_CLUSTER_ENCODE_IMAGES_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/image_patch.h"
#include "daemon/cluster_store.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

// A step's group images by position, each with its serialization, made once: it checks a patch's
// CRC, is compared with the image this node reported, sizes the journal record and is what the
// journal writes.
struct GroupImages {
  std::vector<v1::NodeImage> images;
  std::vector<std::string> bytes;
  // The record of the base step the images were built on.
  std::weak_ptr<const v1::JournalCluster> base;
  // By position, for each image built on its base (the record's image of the member): the
  // positions of the regions it changed, a patched image's, none for an absent member's copy. The
  // image's other regions are its base's, entry for entry.
  std::map<int, std::vector<uint32_t>> changed_regions;
  // The positions of changed_regions whose image carries fields this build does not know.
  std::set<int> unknown_fields;
};

// A record a commit replaced, held by nobody else: the memory the next step's images are built in.
// When the record that replaced it was built on it (the images of its step on this record's),
// `base_of` names that record and `differs_at` holds, by position, where its image differs from
// this one's (ImageMemory::differs_at); a position whose memory is taken leaves `differs_at`.
struct SpareRecord {
  std::shared_ptr<v1::JournalCluster> record;
  std::weak_ptr<const v1::JournalCluster> base_of = {};
  std::map<int, std::vector<uint32_t>> differs_at = {};

  // Position `position`'s image of `record` to build in (its contents go), or an empty one; with
  // its differences from `committed`'s image when `committed` is `base_of`.
  ImageMemory Memory(int position, const std::shared_ptr<const v1::JournalCluster>& committed);
};

// Whether `taken` was taken from `record` (the same object, alive or not), told apart without
// sharing it: a record held by nobody else stays so.
bool IsRecord(const std::weak_ptr<const v1::JournalCluster>& taken,
              const std::shared_ptr<const v1::JournalCluster>& record);

// The positions in this node's group of the nodes an encode names absent (a degraded step), each
// with a placeholder naming it alone in the request, this node among them only in a parity_only
// encode, and the parity receivers among them; INVALID_ARGUMENT when they are not so.
absl::StatusOr<std::set<int>> AbsentPositions(const v1::EncodeRequest& request,
                                              const Topology& topology);

// What an Encode carries of each member, parsed and checked (ParseEncodeImages): a whole image in
// the memory of the image it replaces, a patch's changes and an absent member's placeholder on
// their own.
struct SentImages {
  // INVALID_ARGUMENT when an image is not one or not valid, or a patch is not of a live member
  // or not its only one.
  absl::Status status;
  std::vector<v1::NodeImage> images;  // by position
  std::map<int, const v1::ImagePatch*> patches;  // the request's, by position of their member
  // The memory the step's images are built in.
  SpareRecord spare;
  std::vector<int> parsed_in_spare;  // the positions whose image was parsed in its memory
  // `spare` with the memory the parsed images took back in it, for a request refused before its
  // images were built: the next one builds in it (knowing nothing of the positions given back).
  SpareRecord Unused() &&;
};
SentImages ParsedImages(const v1::EncodeRequest& request, const Topology& topology,
                        const std::set<int>& absent, SpareRecord spare);

// The group's images of the step an Encode carries, by position: as sent, built from their
// patches on `committed` (the record of the base step, with its images' bytes), or, for the
// absent members, their images there; INVALID_ARGUMENT unless each is its member's and valid
// (CheckNodeImage; one built on `committed` at the regions it changed, CheckPatchedImage, for
// `committed`'s images were checked when the record was made). A whole image's bytes are the
// coordinator's serialization of it. The others are built in the memory of `sent.spare`.
absl::StatusOr<GroupImages> GroupImagesOf(const v1::EncodeRequest& request,
                                          const Topology& topology,
                                          const ClusterStore::RecordWithBytes& committed,
                                          const std::set<int>& absent, SentImages sent);

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_ENCODE_IMAGES_H_
