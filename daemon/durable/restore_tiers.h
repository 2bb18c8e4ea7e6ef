// The trainer's and operator's entry to both tiers: LatestCommitted and Restore answer from the
// daemons' memory while every node still holds the committed state, and from the newest step
// durable on every node once one does not, transparently to the trainer (the responses say which
// tier served them). Also the durable tier's listing, the tier the next restore would use, and
// the export of a step from either tier.
#ifndef MOESNAP_DAEMON_DURABLE_RESTORE_TIERS_H_
#define MOESNAP_DAEMON_DURABLE_RESTORE_TIERS_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/durable/drainer.h"
#include "daemon/durable/job_view.h"
#include "daemon/durable/tier_choice.h"
#include "daemon/store.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::durable {

// Thread-safe. `drainer` null: no durable tier, every answer comes from memory as the store gives
// it. Every pointer must outlive this object.
class RestoreTiers {
 public:
  RestoreTiers(uint32_t node_id, Store* store, Drainer* drainer, JobView* view)
      : node_id_(node_id), store_(store), drainer_(drainer), view_(view) {}

  absl::StatusOr<v1::LatestCommittedResponse> LatestCommitted(uint32_t rank, absl::Time deadline);
  // `remote`: as Store::Restore's, the replica-group regions whose other pieces are elsewhere.
  absl::StatusOr<v1::RestoreResponse> Restore(uint32_t rank, std::optional<int64_t> step,
                                              const std::vector<std::string>& regions,
                                              absl::Time deadline,
                                              std::vector<GroupRegion>* remote = nullptr);
  absl::StatusOr<v1::RestoreTierResponse> Tier(uint32_t rank, absl::Time deadline);
  v1::DurableStatus DurableStatus() const;
  // The steps on this node's disk, and the newest durable on every node as the cluster records it.
  v1::ListDurableResponse ListDurable();
  // Streams a step (ExportRequest) to `send`, which returns false when the receiver went away.
  absl::Status Export(const v1::ExportRequest& request,
                      const std::function<bool(const v1::ExportChunk&)>& send);

 private:
  // Decides, retrying until `deadline` while a node still rebuilds or does not answer.
  absl::StatusOr<TierChoice> Choose(uint32_t rank, absl::Time deadline);
  absl::StatusOr<TierChoice> ChooseOnce(uint32_t rank, absl::Time deadline);

  const uint32_t node_id_;
  Store* const store_;
  Drainer* const drainer_;
  JobView* const view_;
  absl::Mutex load_mutex_;  // held while state is loaded from disk into memory
};

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_RESTORE_TIERS_H_
