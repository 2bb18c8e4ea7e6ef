// Unit transfer: the cluster's bytes over the data plane. Sends this node's data units (or their
// deltas) to their stripes' parity holders, serves the units a rebuilding or repairing peer asks
// for and the regions an elastic restore asks for, and receives frames: parity deltas go to the
// parity store, fetched units and regions into the buffers a fetch registered for them.
#ifndef MOESNAP_DAEMON_CLUSTER_TRANSFER_H_
#define MOESNAP_DAEMON_CLUSTER_TRANSFER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/peer_requests.h"
#include "daemon/cluster_store.h"
#include "daemon/data_plane.h"
#include "daemon/node_image.h"
#include "daemon/parity_store.h"
#include "daemon/step_changes.h"

namespace moesnap::daemon::cluster {

// What a fetch waits for: unit `unit` of stripe `stripe` sent by node `rank` (kFetchedUnit frames,
// whose rank field names their sender; no region), or region `region` of rank `rank` (kFetchedRegion
// frames; stripe and unit 0), asked for by request `request` (the frames' attempt field). Units are
// keyed by their sender so that decodes on one node fetching the same stripe numbers of different
// groups never meet; both by their request, so that fetches on one node of the same unit or region
// never meet, nor an answer that comes after its fetch was given up a later fetch.
struct FetchKey {
  int64_t step = 0;
  uint64_t stripe = 0;
  uint32_t unit = 0;
  uint32_t rank = 0;
  std::string region;
  int64_t request = 0;
  bool operator<(const FetchKey& other) const {
    return std::tie(step, stripe, unit, rank, region, request) <
           std::tie(other.step, other.stripe, other.unit, other.rank, other.region, other.request);
  }
  std::string Describe() const;
};

// Where a fetched frame's bytes land, and the node asked to send them (on authenticated
// connections, frames for the slot from any other node are refused).
struct FetchSlot {
  uint8_t* buffer = nullptr;
  uint64_t bytes = 0;
  uint32_t source = 0;
  // The slot's owner checks every byte against checksums of its own (FrameSink::InPlace::
  // owner_checks): as it uses them, or, a rebuild's new image, all at once before it is installed.
  // Frames into it are not checked as they land.
  bool owner_checks = false;
};

// Thread-safe.
class Transfer final : public FrameSink {
 public:
  Transfer(const ClusterContext& context, const ClusterStore* store, ParityStore* parity);
  ~Transfer() override;

  // Serves the data plane on `host`:`port` (0: any free port); the port it serves on.
  absl::StatusOr<uint16_t> Start(const std::string& host, uint16_t port);

  // The payload of a frame this node sends (the last of a unit shorter). A unit goes as several
  // frames so that sending, receiving and checking them overlap: the sender checksums the next
  // frame while the receiver reads and checks the last.
  static constexpr uint32_t kFrameBytes = 1 << 20;
  // The largest payload this node accepts in one frame (daemons of before sent 4 MiB).
  static constexpr uint32_t kMaxFrameBytes = 4 << 20;

  // Sends `pieces`, one after another, to each node of `to` as frames of `header` whose offsets
  // start at header.offset; a frame gathers the pieces it spans without copying them, and its CRC
  // is computed once for all of `to`.
  absl::Status SendFrames(absl::Span<const uint32_t> to, FrameHeader header,
                          absl::Span<const absl::Span<const uint8_t>> pieces);
  absl::Status SendFrames(uint32_t to, FrameHeader header,
                          absl::Span<const absl::Span<const uint8_t>> pieces) {
    return SendFrames({&to, 1}, std::move(header), pieces);
  }
  absl::Status SendFrames(absl::Span<const uint32_t> to, FrameHeader header,
                          const uint8_t* bytes, uint64_t length) {
    const absl::Span<const uint8_t> piece(bytes, length);
    return SendFrames(to, std::move(header), {&piece, 1});
  }
  absl::Status SendFrames(uint32_t to, FrameHeader header, const uint8_t* bytes, uint64_t length) {
    return SendFrames({&to, 1}, std::move(header), bytes, length);
  }
  // Sends `pieces`, one after another, to `to` as frames of one stored chunk each (`chunk_bytes`,
  // the last shorter; at most kMaxFrameBytes), each carrying that chunk's CRC-32C as stored
  // (`chunk_crcs`): nothing here passes over the bytes. Bytes that no longer match their stored
  // CRC go out so, and the receiver's check of them against the same CRCs finds it.
  // INVALID_ARGUMENT when the chunks do not fit a frame or their CRCs do not cover the bytes.
  absl::Status SendChunks(uint32_t to, FrameHeader header,
                          absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t chunk_bytes,
                          absl::Span<const uint32_t> chunk_crcs);
  // The positions of the regions of `image` (this node's, of a step that goes as `changes`) that
  // SendDataUnits sends deltas of: those its changed units outside fresh stripes lie in, ascending.
  std::vector<int> DeltaRegions(const NodeImage& image, const StepChanges& changes) const;
  // Sends this node's data units of `step` to their parity holders, as frames of `attempt` (the
  // coordinator's token): all of them, or with `changes` and `committed` (the committed bytes of
  // `image`'s regions, at least of its DeltaRegions: ClusterStore::CommittedBytesOf) the changed
  // ones only, each as its delta against the committed step or, in a fresh stripe, as itself.
  // Parity holders among `absent` (a degraded step's) get nothing. Returns the bytes sent;
  // INVALID_ARGUMENT, before anything is sent, when `committed` lacks a region a delta needs.
  absl::StatusOr<uint64_t> SendDataUnits(
      int64_t step, int64_t attempt, const NodeImage& image,
      const std::vector<std::shared_ptr<PoolBytes>>* committed, const StepChanges* changes,
      const std::set<uint32_t>& absent);
  // Pushes units of the committed step to a rebuilding or repairing node (SendUnits).
  absl::StatusOr<v1::SendUnitsResponse> ServeUnits(const v1::SendUnitsRequest& request);
  // This node's units `refs` ((stripe, unit index) pairs) of the committed step `step`, held: the
  // memory they lie in (`spans[i]` for refs[i], in order) stays that step's while the result
  // exists, since committed units are never written. A helper decoding for a rebuilding node reads
  // its own units from there.
  struct HeldUnits {
    std::vector<std::pair<uint64_t, uint32_t>> refs;
    NodeImage image;
    std::vector<std::shared_ptr<PoolExtent>> extents;  // of the parity units among them
    std::vector<std::vector<absl::Span<const uint8_t>>> spans;
    // A parity unit's CRC-32C as stored, not checked here; none for a data unit (its regions'
    // chunk CRCs check it where it is used).
    std::vector<std::optional<uint32_t>> parity_crcs;
    // OK unless refs[i] is a parity unit whose bytes fail its stored CRC-32C: a pass over them,
    // which with `frame_crcs` also gives the CRC-32C of each of the unit's frames of `frame_bytes`
    // (the last shorter), so that sending it needs no second pass.
    absl::Status CheckParity(size_t i, uint64_t frame_bytes = 0,
                             std::vector<uint32_t>* frame_crcs = nullptr) const;
  };
  absl::StatusOr<HeldUnits> HoldOwnUnits(
      int64_t step, const std::vector<std::pair<uint64_t, uint32_t>>& refs) const;

  // Asks `holder` for regions `regions` (1 to RegionRequest::kMaxRegions) of rank `rank` of its
  // committed step `step` in one request, on the data plane: it sends them back one after another,
  // each as its frames (kFetchedRegion, each chunk with its stored CRC-32C) or a refusal that fails
  // that region's fetch with its reason. The regions' slots are expected before. A holder serves
  // kRegionRequestsPerPeer requests of one node at once and refuses more (busy); it closes the
  // connection of a node with kRegionRequestsQueuedPerPeer requests queued.
  static constexpr int kRegionRequestsPerPeer = 8;
  static constexpr int kRegionRequestsQueuedPerPeer = 4 * kRegionRequestsPerPeer;
  absl::Status RequestRegions(uint32_t holder, int64_t step, uint32_t rank,
                              absl::Span<const absl::string_view> regions, int64_t request);
  // A request token for a fetch's regions or units, new on each call (FetchKey::request, carried
  // in SendUnitsRequest and DecodeUnitsRequest and in the answers' frames). Answers that name
  // a token this node issued and no longer awaits come after their fetch ended: they are read and
  // dropped. Answers naming a token it never issued close the connection. Tokens start from the
  // clock's microseconds, so a restarted daemon takes answers to its former self's requests as
  // late ones.
  int64_t NewRequest() { return ++requests_issued_; }

  // Expects the frames of `slots` into their buffers; registered before the request that makes a
  // peer send them goes out. UNAVAILABLE, registering none, when a key is expected already;
  // INVALID_ARGUMENT, registering none, when `slots` names a key twice.
  absl::Status Expect(const std::vector<std::pair<FetchKey, FetchSlot>>& slots);
  // After the requests that make peers send them returned `sent`: waits until every expected byte
  // arrived (when they succeeded) and forgets the keys either way, returning once no frame is
  // being read into the slots' buffers. A fetch fails with DATA_LOSS when a frame failed its check
  // in its slot, FAILED_PRECONDITION when its sender refused it, UNAVAILABLE when its sender is
  // lost, DEADLINE_EXCEEDED when no byte of it came for kFetchWait (or it came slower than a
  // floor on the rate).
  static constexpr absl::Duration kFetchWait = absl::Seconds(30);
  absl::Status Collect(const std::vector<FetchKey>& keys, absl::Status sent);

  // Fetch slots registered and not collected yet, and the bytes they still miss (what a rebuild
  // waits for).
  std::pair<size_t, uint64_t> FetchesWaiting();

  // FrameSink. A fetched frame is read straight into its slot (Reserve, then Filled): a frame
  // that fails its check there fails the fetch (DATA_LOSS); one into an owner-checked slot is not
  // checked there. Parity deltas, region requests and refusals are accepted from the connection's
  // buffer; a region request is served on a thread of PeerRequests. On an authenticated
  // connection a parity delta is accepted only from the node whose data unit it names, a fetched
  // frame or a refusal only from the node asked for it, a region request only for its sender.
  absl::StatusOr<std::optional<InPlace>> Reserve(const FrameHeader& header,
                                                 std::optional<uint32_t> sender) override;
  void Filled(const FrameHeader& header, const absl::Status& checked) override;
  absl::Status Accept(const FrameHeader& header, absl::Span<const uint8_t> payload,
                      std::optional<uint32_t> sender) override;
  // Fails at once the fetches awaiting frames from the peer whose connection was closed (its node
  // when authenticated, else every node reached at its address): frames it wrote behind the one
  // refused are lost, and would otherwise be waited for until kFetchWait.
  void ConnectionClosed(std::optional<uint32_t> sender, const std::string& address,
                        const absl::Status& why) override;
  // Connections the data plane closed over a frame, ever, and the last: from where and why.
  std::pair<uint64_t, std::string> ConnectionsClosed() {
    absl::MutexLock lock(&fetch_mutex_);
    return {connections_closed_, last_connection_closed_};
  }

 private:
  struct Connection {
    uint64_t incarnation = 0;
    std::shared_ptr<DataPlaneClient> client;
  };
  // The data-plane client to `id`'s current incarnation, connected on first use.
  absl::StatusOr<std::shared_ptr<DataPlaneClient>> Client(uint32_t id);

  // This node's unit `unit` of `stripe` of the committed step `step`: its data unit's index in
  // the image, or its parity unit.
  struct OwnUnit {
    uint64_t data_unit = 0;  // when `parity` is empty
    std::optional<ParityUnit> parity;
  };
  absl::StatusOr<OwnUnit> FindOwnUnit(int64_t step, uint64_t stripe, uint32_t unit) const;

  absl::Status AcceptParityDelta(const FrameHeader& header, absl::Span<const uint8_t> payload,
                                 std::optional<uint32_t> sender);
  absl::Status AcceptRegionRequest(const FrameHeader& header, absl::Span<const uint8_t> payload,
                                   std::optional<uint32_t> sender);
  absl::Status AcceptRefusal(const FrameHeader& header, absl::Span<const uint8_t> payload,
                             std::optional<uint32_t> sender);
  // Sends the committed region `request` names to node `to`, or tells it why not: `busy` when it
  // asked for more than its share, or the region holds more than `room` bytes (what is left of its
  // request's bound; a region sent takes its bytes from it). False when `to` could not be told
  // either.
  bool ServeRegion(uint32_t to, const FrameHeader& request, bool busy, uint64_t* room);
  absl::Status SendRegion(uint32_t to, const FrameHeader& request, uint64_t* room);

  const ClusterContext context_;
  const ClusterStore* const store_;
  ParityStore* const parity_;
  std::unique_ptr<DataPlaneServer> server_;

  absl::Mutex connections_mutex_;
  std::map<uint32_t, Connection> connections_ ABSL_GUARDED_BY(connections_mutex_);

  // An expected slot, and the frames being read into it.
  struct Awaited {
    FetchSlot slot;
    uint64_t missing = 0;   // bytes not arrived (checked, unless the owner checks) yet
    int writers = 0;        // frames being read in
    std::map<uint64_t, uint64_t> taken;  // [offset, end) of every frame read in or being read in
    std::string failure;    // why the fetch failed (empty: it did not)
    absl::StatusCode failure_code = absl::StatusCode::kDataLoss;
    bool closed = false;    // being collected: takes no more frames
  };
  // Whether a fetched frame or a refusal names a request this node made (awaited or not).
  bool AnswersARequestMadeHere(const FrameHeader& header) const;
  std::atomic<int64_t> requests_issued_;

  // Collect waits on fetch_mutex_ for its keys' bytes (a Condition: it is woken only when they
  // arrive), and on fetched_ for the frames still being read into them.
  absl::Mutex fetch_mutex_;
  absl::CondVar fetched_;  // a frame was read into a slot
  std::map<FetchKey, Awaited> fetches_ ABSL_GUARDED_BY(fetch_mutex_);
  uint64_t fetch_failures_ ABSL_GUARDED_BY(fetch_mutex_) = 0;  // fetches failed, ever
  uint64_t connections_closed_ ABSL_GUARDED_BY(fetch_mutex_) = 0;
  std::string last_connection_closed_ ABSL_GUARDED_BY(fetch_mutex_);

  // Last: its threads serve requests with the members above, and are joined first.
  std::atomic<bool> stopping_{false};
  std::unique_ptr<PeerRequests> region_requests_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_TRANSFER_H_
