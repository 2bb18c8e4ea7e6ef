// A group member's side of a rebuild at a helper (DecodeUnits): it fetches the other sources of
// each stripe it is asked for from their nodes, decodes the unit the rebuilding node lacks and
// sends it on, so the rebuilding node's link carries one unit per stripe.
#ifndef MOESNAP_DAEMON_CLUSTER_DECODE_HELPER_H_
#define MOESNAP_DAEMON_CLUSTER_DECODE_HELPER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/transfer.h"
#include "daemon/cluster_store.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

// Thread-safe.
class DecodeHelper {
 public:
  // `request_bytes`: RebuildOptions::helper_request_bytes, what one request may take to decode.
  DecodeHelper(const ClusterContext& context, const ClusterStore* store, Transfer* transfer,
               uint64_t request_bytes);

  // Checks `request` against the step this node holds, fetches each stripe's sources (its own
  // unit read here), decodes the target unit and sends it to request.to_node. One request at a
  // time; CANCELLED once `cancelled` says the caller gave up. The memory it decodes in is kept for
  // the next request (at most HelperRequestBound()): a rebuild sends each helper one request after
  // another, and fresh memory of that size costs more in page faults than the decode itself.
  absl::StatusOr<v1::DecodeUnitsResponse> DecodeFor(const v1::DecodeUnitsRequest& request,
                                                    const std::function<bool()>& cancelled);

 private:
  // A stripe being decoded: its n units, of which `chosen` (k of them, filled by FetchSources) and
  // `target` (decoded) have memory (in scratch, or this node's own unit where it lies), the others
  // null.
  struct StripeUnits {
    uint64_t stripe = 0;
    uint64_t length = 0;
    int target = 0;
    std::vector<int> chosen;
    std::vector<uint8_t*> units;
  };
  // Fills each stripe's chosen units of `step` (group `group`, images of `sizes`): the others'
  // fetched into scratch, this node's own pointed to where they lie (held in `own` meanwhile) or,
  // when they do not lie in one piece or need padding, copied. Returns the bytes fetched.
  absl::StatusOr<uint64_t> FetchSources(int64_t step, int group,
                                        const std::vector<uint64_t>& sizes,
                                        std::vector<StripeUnits>& works, Transfer::HeldUnits* own);

  const ClusterContext context_;
  const ClusterStore* const store_;
  Transfer* const transfer_;
  const uint64_t request_bytes_;

  absl::Mutex mutex_;  // one decode at a time
  std::unique_ptr<uint8_t[]> scratch_ ABSL_GUARDED_BY(mutex_);
  uint64_t scratch_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_DECODE_HELPER_H_
