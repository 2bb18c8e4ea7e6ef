// Remote (elastic) restore: a rank restores regions that another rank snapshotted on another node
// (an expert moved after failures). The node that holds them sends them when asked over the data
// plane (Transfer::RequestRegions, many regions a request), or, when that node is lost, the units
// covering them are decoded from its group's survivors; every chunk's CRC-32C is checked as the
// bytes are written into the rank, and fetched bytes that fail it are decoded from the group
// instead.
#ifndef MOESNAP_DAEMON_CLUSTER_REMOTE_RESTORE_H_
#define MOESNAP_DAEMON_CLUSTER_REMOTE_RESTORE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/kept_buffers.h"
#include "daemon/cluster/rebuild.h"
#include "daemon/cluster/transfer.h"
#include "daemon/cluster_store.h"

namespace moesnap::daemon::cluster {

// Thread-safe.
class RemoteRestore {
 public:
  RemoteRestore(const ClusterContext& context, ClusterStore* store, Transfer* transfer,
                Rebuilder* rebuilder);

  // Restores into `rank` what `source_rank` snapshotted: from this node's committed state, else
  // from the node that holds it, else decoded from that node's group.
  absl::StatusOr<v1::RestoreResponse> RestoreFrom(uint32_t rank, uint32_t source_rank,
                                                  const std::vector<std::string>& regions);

  // The serving side: which node's committed image holds a rank, from this node's group record.
  v1::LocateRankResponse Locate(const v1::LocateRankRequest& request) const;

  // Host memory holding restores' fetched bytes now: in use, or kept for the next restores.
  uint64_t buffer_bytes() const { return buffers_.held_bytes(); }

 private:
  // Which node holds `source_rank`'s committed image, with its group's record of that step. Unless
  // `ask`: the answer kept from an earlier restore while this node's committed step is still that
  // record's, or this node's own record for a rank of its group. Else (`asked`) the answer of
  // every live node, kept.
  absl::StatusOr<v1::LocateRankResponse> Located(uint32_t source_rank, bool ask, bool* asked);
  void ForgetLocation(uint32_t source_rank);

  // A region of the source rank asked for: its record in the holder's image, where it starts
  // there, and where its bytes land once fetched or decoded (in its batch's kept buffer).
  struct WantedRegion {
    const v1::ImageRegion* region;
    uint64_t start;
    absl::Span<uint8_t> bytes;
  };
  absl::StatusOr<v1::RestoreResponse> RestoreLocated(uint32_t rank, uint32_t source_rank,
                                                     const std::vector<std::string>& names,
                                                     const v1::LocateRankResponse& found,
                                                     bool decode_if_fetch_fails);
  // Restores `batch` (of `bytes` in all) into `rank` through one buffer: fetched from the holder
  // unless `holder_failed`, each request's regions written into the rank while the next ones are
  // fetched. The regions the holder did not send (the fetch failed and `decode_if_fetch_fails`,
  // which then sets `holder_failed`; all of them once it is set) and those whose fetched bytes
  // fail their stored checksums are decoded from the group. Whether any was decoded.
  absl::StatusOr<bool> RestoreBatch(uint32_t rank, uint32_t source_rank,
                                    const v1::LocateRankResponse& found, int group, int position,
                                    uint64_t bytes, absl::Span<WantedRegion> batch,
                                    bool decode_if_fetch_fails, bool& holder_failed);
  // The regions from the live node `holder` that holds them, asked for on the data plane. Each
  // request's regions go to `collected` as soon as they are all in (in the order of `wanted`, on
  // this thread, while later requests are in flight); its error ends the fetch and is returned.
  using Collected = absl::FunctionRef<absl::Status(absl::Span<const WantedRegion>)>;
  absl::Status FetchFromHolder(uint32_t holder, int64_t step, uint32_t source_rank,
                               absl::Span<const WantedRegion> wanted, Collected collected);
  // The regions decoded from the group's survivors, the node at `position` being lost.
  absl::Status DecodeFromGroup(const v1::JournalCluster& record, int group, int position,
                               absl::Span<const WantedRegion> wanted);

  // Takes `count` of the region requests this node may have in flight to `holder`, all at once,
  // waiting for other restores to release theirs.
  void TakeRequests(uint32_t holder, size_t count);
  void ReleaseRequests(uint32_t holder, size_t count);

  const ClusterContext context_;
  ClusterStore* const store_;
  Transfer* const transfer_;
  Rebuilder* const rebuilder_;
  KeptBuffers buffers_;
  absl::Mutex located_mutex_;
  std::map<uint32_t, v1::LocateRankResponse> located_ ABSL_GUARDED_BY(located_mutex_);
  absl::Mutex requests_mutex_;
  absl::CondVar requests_ended_;
  std::map<uint32_t, size_t> requests_in_flight_ ABSL_GUARDED_BY(requests_mutex_);
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_REMOTE_RESTORE_H_
