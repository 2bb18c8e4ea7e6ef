// What the store offers the cluster, and nothing else: the node's image of a captured step, the
// commit or abort of a step the cluster decided, the committed image and record that parity and
// rebuilds work from, and the few reads and writes of remote restore and repair. The Store
// implements it; the cluster's unit tests put a fake here. The cluster calls down into the store;
// the store never calls up into the cluster.
#ifndef MOESNAP_DAEMON_CLUSTER_STORE_H_
#define MOESNAP_DAEMON_CLUSTER_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/node_image.h"
#include "daemon/pool.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

// Where this node's trainers are with a step.
enum class NodeCapture {
  kCaptured,  // every rank captured it, or a rank failed it (its Prepare says why)
  kNotYet,    // a rank has not reached it yet
  kPassed,    // every rank went past it in its present timeline without capturing it
};

// Every method is thread-safe.
class ClusterStore {
 public:
  virtual ~ClusterStore() = default;

  // The lowest step that every rank of this node with registered regions has captured and that
  // this call has not returned since: each capture of a step is offered once, and a step a rank
  // captures again (a replacement trainer replaying it, a whole-rank restore taking step numbers
  // again) is offered again. DEADLINE_EXCEEDED when none is by `deadline`.
  virtual absl::StatusOr<int64_t> WaitNewNodeCapture(absl::Time deadline) = 0;
  virtual NodeCapture CaptureOf(int64_t step) const = 0;
  // Waits until every rank with registered regions has captured `step`, then returns the node's
  // image of it: the step's new versions and, for regions it did not capture, the committed ones.
  virtual absl::StatusOr<NodeImage> WaitNodeCaptured(int64_t step, absl::Time deadline) = 0;
  // The committed image (what parity of the committed step covers).
  virtual NodeImage CommittedImage() const = 0;
  // The committed bytes of the regions at `positions` of `image`, this node's image in the
  // cluster's record of the committed step: what the deltas of the units those regions lie in
  // XOR with (NodeImage::XorWith). One entry per region of `image`, null but at `positions`; each
  // found by name, so a step that changes a few regions of thousands looks up only those.
  // FAILED_PRECONDITION when a committed version is not the one `image` names (missing, or of
  // another step or size): the store and the record disagree, and a delta would corrupt parity.
  // INVALID_ARGUMENT for a position outside `image`.
  virtual absl::StatusOr<std::vector<std::shared_ptr<PoolBytes>>> CommittedBytesOf(
      const v1::NodeImage& image, absl::Span<const int> positions) const = 0;
  // One region of the committed image, found without building the image: its record and its
  // bytes (held while the result lives). FAILED_PRECONDITION when the committed step is not
  // `step`; NOT_FOUND when this node holds no such region of `rank`.
  struct HeldRegion {
    v1::ImageRegion record;
    std::shared_ptr<PoolBytes> stored;
  };
  virtual absl::StatusOr<HeldRegion> CommittedRegion(int64_t step, uint32_t rank,
                                                     const std::string& region) const = 0;
  // Commits `step` for every rank that captured it, with the cluster's record, in one journal
  // write; older captured steps are aborted as superseded. `image_bytes` holds the record's group
  // images serialized, in order (the caller serialized them already, to check them): the journal
  // copies them instead of serializing every region again. INVALID_ARGUMENT when they are not one
  // per image. Returns the record as ClusterRecord gives it now.
  virtual absl::StatusOr<std::shared_ptr<const v1::JournalCluster>> CommitNodeStep(
      int64_t step, v1::JournalCluster cluster, std::vector<std::string> image_bytes) = 0;
  virtual void AbortNodeStep(int64_t step, const absl::Status& why) = 0;
  // Replaces every committed version by a rebuilt image and journals it with `cluster`.
  virtual absl::Status InstallImage(const NodeImage& image, v1::JournalCluster cluster) = 0;
  // Forgets the cluster record for as long as the process lives, for one that cannot be used: the
  // node then holds no committed step of the cluster and rebuilds from its group. The journal keeps
  // the record until its next write; the parity the record lists is not claimed from the pool.
  virtual void ForgetClusterRecord() = 0;
  // The cluster record of the committed step (empty on a fresh pool). It holds every group
  // member's image, region by region, so it is shared rather than copied: a commit replaces it,
  // and the record a caller holds never changes while another holds it too. (A record is made
  // mutable and shared as const: the participant, once the only holder of one a commit replaced,
  // builds the next step's images in its memory.) Every image in it passed the cluster's checks
  // of a peer's image (CheckNodeImage): a commit's and an install's were checked before the
  // cluster handed them over, and those of the record read back from the journal are checked as
  // the cluster starts (the record forgotten, ForgetClusterRecord, when one fails).
  virtual std::shared_ptr<const v1::JournalCluster> ClusterRecord() const = 0;
  // The same with its group images serialized, as its journal holds them, taken together:
  // (*image_bytes)[i] serializes record->group_images(i).
  struct RecordWithBytes {
    std::shared_ptr<const v1::JournalCluster> record;
    std::shared_ptr<const std::vector<std::string>> image_bytes;

    // The bytes of record->group_images(position); empty where the bytes are not one per image,
    // and the caller serializes the image instead.
    std::string_view ImageBytesOf(int position) const {
      if (image_bytes->size() != static_cast<size_t>(record->group_images_size())) return {};
      return (*image_bytes)[position];
    }
  };
  virtual RecordWithBytes ClusterRecordWithBytes() const = 0;
  // OK when this node's journal can hold the commit of the step this node captured as `own`
  // (`group_images[own_position]` serialized), whose group images serialized are `group_images`,
  // with parity records for `stripes` stripes;
  // RESOURCE_EXHAUSTED, saying how large the journal must be, when it cannot. Checked before the
  // node encodes, so that a step no journal here could hold aborts instead of committing.
  virtual absl::Status JournalRoomFor(const NodeImage& own, int own_position,
                                      const std::vector<std::string>& group_images,
                                      uint64_t stripes) const = 0;
  virtual uint64_t CommittedBytes() const = 0;
  // Bytes of captures not committed yet.
  virtual uint64_t InFlightBytes() const = 0;
  // Elastic restore: writes a region that another rank snapshotted (its record `stored`, its
  // bytes) into this rank's registered region of the same name, checking size, dtype, shape and
  // every chunk's CRC-32C as the bytes land.
  virtual absl::Status WriteRegion(uint32_t rank, const v1::ImageRegion& stored,
                                   const PoolBytes& bytes) = 0;
  // The same from this node's committed versions of `source_rank`; NOT_FOUND when this node holds
  // none of that rank.
  virtual absl::StatusOr<v1::RestoreResponse> RestoreFromRank(
      uint32_t rank, uint32_t source_rank, const std::vector<std::string>& regions) = 0;
  // Recomputes every chunk's CRC-32C of `step` (the committed versions when absent).
  virtual v1::VerifyResponse Verify(std::optional<int64_t> step) const = 0;
};

// The group images of `cluster`, each serialized: the bytes CommitNodeStep takes with it.
std::vector<std::string> SerializedImages(const v1::JournalCluster& cluster);

// An upper bound of the journal state a node writes when it commits such a step: its own image
// as versions (each region's entry with its pool extents, and the rank records the image
// carries), every member's image and a parity record per stripe. `own` is serialized at
// `group_images[own_position]`: its entries are sized from there, not walked again.
// INVALID_ARGUMENT when `own_position` is not one of `group_images`.
absl::StatusOr<uint64_t> CommitJournalBound(const NodeImage& own, int own_position,
                                            const std::vector<std::string>& group_images,
                                            uint64_t stripes);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_CLUSTER_STORE_H_
