// The parity units this node holds for its group, per step. A step's units are opened when the
// coordinator tells the node every image size of the group, filled as the data nodes' units arrive
// over the data plane (each added with its Reed-Solomon coefficient), and are complete when every
// expected byte has arrived. A unit starts from zeros or from the committed unit without a pass of
// its own: the first frame to reach a byte writes it from its starting value, and the bytes no
// frame reached are filled in once the step is complete. The committed step's units stay until
// the next step commits.
// Each opening is one attempt (the coordinator's fencing token): a step opened again by a newer
// coordinator starts afresh, and frames of an older attempt are dropped.
// A node that rebuilds while steps commit without it (cluster.allow_degraded) accumulates instead:
// each step's units start at zero and take only the live nodes' deltas, so they hold the change of
// its parity in that step. Those of committed steps are kept until the rebuilt units are there to
// fold them into (parity of step S = parity of its base XOR the accumulation of S).
#ifndef MOESNAP_DAEMON_PARITY_STORE_H_
#define MOESNAP_DAEMON_PARITY_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/frame.h"
#include "daemon/pool.h"
#include "daemon/step_changes.h"
#include "erasure/reed_solomon.h"
#include "erasure/stripe_layout.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

struct ParityUnit {
  uint64_t stripe = 0;
  uint64_t bytes = 0;
  uint32_t crc = 0;  // set once complete
  std::shared_ptr<PoolExtent> extent;
};

// Thread-safe.
class ParityStore {
 public:
  // A frame for a step not opened yet waits up to `begin_wait` (the commit timeout) for it.
  ParityStore(Pool* pool, const erasure::ReedSolomon* codec, const erasure::StripeLayout* layout,
              int position, absl::Duration begin_wait);

  // Claims the committed units recorded in the journal (the pool was re-attached).
  absl::Status Recover(const v1::JournalCluster& record);

  // Opens `step`: a unit for every stripe in which this node is a parity holder and some data node
  // has bytes, given each group position's image size. Without `changes`, units start at zero and
  // every data unit is expected (a full encode). With them (a step of an unchanged layout), units
  // start from the committed ones and only the deltas of the changed units are expected;
  // a stripe none of whose data units changed keeps the committed unit itself, shared (no frame is
  // taken for it); a fresh stripe's unit starts at zero and takes every data unit itself.
  // Opening a step again with a newer `attempt` replaces the older attempt's units. With
  // `accumulate` (and `changes`, of which no stripe this node holds may be fresh), units start at
  // zero: they take the step's change only.
  absl::Status Begin(int64_t step, int64_t attempt, const std::vector<uint64_t>& image_bytes,
                     const StepChanges* changes, bool accumulate = false);
  // The parity bytes this node holds for a group of `image_bytes`, and whether the pool has room
  // for them now.
  uint64_t UnitBytes(const std::vector<uint64_t>& image_bytes) const;
  bool Fits(const std::vector<uint64_t>& image_bytes) const;
  // Adds a kParityDelta frame's payload to its unit. Waits briefly for Begin of its attempt (a fast
  // data node's units can arrive before the coordinator's Encode reaches this node); a frame of an
  // older attempt than the one open is dropped. INVALID_ARGUMENT for bytes of a data unit the step
  // does not expect, outside the unit, or that arrived already.
  absl::Status Accept(const FrameHeader& header, absl::Span<const uint8_t> payload);
  // Waits until every expected byte of `step` has arrived, then fills in what no frame wrote and
  // checksums the units. UNAVAILABLE once the connection of a member it waited for closed
  // (FailIncomplete).
  absl::Status WaitComplete(int64_t step, absl::Time deadline);
  // A connection from the members at group `positions` closed over a bad frame (`why`), and the
  // deltas it carried behind it are lost: every step still waiting for data from one of them fails
  // at once instead of waiting out the commit timeout (its step aborts; the next one goes on). A
  // step that has all their data waits on for the others'.
  void FailIncomplete(absl::Span<const int> positions, const std::string& why);
  // The journal record of one unit.
  static v1::JournalParity RecordOf(const ParityUnit& unit);
  // The journal records of `step`'s complete units.
  std::vector<v1::JournalParity> Records(int64_t step) const;
  // `step` becomes the committed parity; the previous committed units are freed.
  void Commit(int64_t step);
  void Abort(int64_t step);
  // `step` was decided aborted: its parity goes, and its frames that arrive later are dropped
  // without closing their connection (later steps' frames follow on it).
  void Discard(int64_t step);
  // Replaces the committed units (rebuild); accumulations of steps up to `step` go.
  void Install(int64_t step, std::vector<ParityUnit> units);

  // `step`, accumulated (Begin with `accumulate`) and complete, was committed against `base`
  // without this node: its accumulation is kept, with the group's images of the step, until
  // folded. False when it was not accumulated under `attempt`.
  bool KeepAccumulated(int64_t step, int64_t attempt, int64_t base,
                       std::vector<v1::NodeImage> group_images);
  // The kept step whose base is the committed step, with its group images, if any (not one folded
  // already: a fold is done once).
  std::optional<std::pair<int64_t, std::vector<v1::NodeImage>>> NextAccumulated() const;
  // Folds the committed units into the accumulation of `step` (the committed step must be its
  // base): the result is `step`'s parity, whose journal records are returned; Commit(step) makes
  // it the committed parity.
  absl::StatusOr<std::vector<v1::JournalParity>> FoldAccumulated(int64_t step);
  // Kept accumulations (committed steps not folded yet).
  size_t accumulated_steps() const;
  // The committed unit of `stripe` (nullopt when this node holds none for it).
  std::optional<ParityUnit> Committed(uint64_t stripe) const;
  // The same, only while the committed step is `step`.
  std::optional<ParityUnit> CommittedOf(int64_t step, uint64_t stripe) const;
  std::vector<ParityUnit> CommittedUnits() const;
  uint64_t committed_bytes() const;
  uint64_t in_flight_bytes() const;

  // Units Begin opened since this store was made, by how they started (a step opened again by a
  // newer attempt counts again).
  struct Openings {
    uint64_t whole = 0;        // at zero, taking every data unit (a full encode)
    uint64_t fresh = 0;        // at zero, taking the changed units themselves (a fresh stripe)
    uint64_t updated = 0;      // from the committed unit, taking deltas
    uint64_t shared = 0;       // the committed unit itself: no data unit of its stripe changed
    uint64_t accumulated = 0;  // at zero, taking deltas: the step's change, at a node that rebuilds

    Openings& operator+=(const Openings& other) {
      whole += other.whole;
      fresh += other.fresh;
      updated += other.updated;
      shared += other.shared;
      accumulated += other.accumulated;
      return *this;
    }
  };
  Openings openings() const;

 private:
  // What frames have written of an open unit so far. Guarded by the unit's stripe lock.
  struct UnitWrites {
    std::shared_ptr<PoolExtent> start;     // the committed unit it starts from; null: zeros
    std::map<uint64_t, uint64_t> written;  // disjoint, non-adjacent byte ranges: begin -> end
  };

  // One data unit of an open stripe: its length in the step (0: nothing of it is expected) and
  // the byte ranges of it that arrived. Each byte arrives once: a frame overlapping one that
  // arrived, or reaching past the unit, is refused, so that no frame stands in for another.
  struct UnitArrivals {
    uint64_t length = 0;
    std::map<uint64_t, uint64_t> arrived;  // disjoint, non-adjacent byte ranges: begin -> end
  };
  using StripeArrivals = absl::InlinedVector<UnitArrivals, 8>;  // by data unit index in the stripe

  struct Pending {
    uint64_t opening = 0;  // names the Begin that made it: a step opened again starts afresh
    int64_t attempt = 0;
    std::map<uint64_t, ParityUnit> units;
    std::map<uint64_t, std::shared_ptr<UnitWrites>> writes;  // of every unit not shared
    std::map<uint64_t, StripeArrivals> arrivals;  // of each stripe's data units
    std::set<uint64_t> shared;  // stripes none of whose data units changed: the committed unit
    uint64_t missing = 0;
    std::vector<uint64_t> missing_from;  // per group position: bytes still to arrive from it
    bool complete = false;
    bool accumulate = false;  // started at zero: the step's change only
    std::string failure;      // why it can no longer complete (empty: it can)
  };

  struct Accumulated {
    int64_t base = 0;
    std::vector<v1::NodeImage> group_images;
    std::map<uint64_t, ParityUnit> units;
    bool folded = false;  // holds the step's parity, ready to commit
  };

  Pool* const pool_;
  const erasure::ReedSolomon* const codec_;
  const erasure::StripeLayout* const layout_;
  const int position_;
  const absl::Duration begin_wait_;

  mutable absl::Mutex mutex_;
  absl::CondVar changed_;
  std::map<int64_t, Pending> pending_ ABSL_GUARDED_BY(mutex_);
  uint64_t openings_made_ ABSL_GUARDED_BY(mutex_) = 0;  // Pending::opening of the last Begin
  Openings openings_ ABSL_GUARDED_BY(mutex_);
  std::set<int64_t> discarded_ ABSL_GUARDED_BY(mutex_);  // decided aborted, after the committed step
  std::optional<int64_t> committed_step_ ABSL_GUARDED_BY(mutex_);
  std::map<uint64_t, ParityUnit> committed_ ABSL_GUARDED_BY(mutex_);
  std::map<int64_t, Accumulated> accumulated_ ABSL_GUARDED_BY(mutex_);  // step ->
  // Adds a frame's payload (data unit `data_index`'s bytes or delta) into the unit at `parity`:
  // bytes no frame wrote yet are written from the unit's start in the same pass.
  absl::Status AddFrame(UnitWrites& writes, int data_index, int parity_index, uint64_t offset,
                        absl::Span<const uint8_t> payload, uint8_t* parity) const;
  // Writes the unit's start into the bytes of `unit` no frame wrote.
  static void FillUnwritten(UnitWrites& writes, const ParityUnit& unit);
  // Whether a frame's bytes of a data unit fit it and arrive for the first time.
  static absl::Status CheckArrival(const FrameHeader& header, const UnitArrivals& arrivals);
  absl::Mutex& StripeLock(uint64_t stripe) const { return stripe_locks_[stripe % kStripeLocks]; }

  // Serializes additions into one unit; one lock per stripe residue keeps contention low.
  static constexpr int kStripeLocks = 64;
  mutable absl::Mutex stripe_locks_[kStripeLocks];
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_PARITY_STORE_H_
