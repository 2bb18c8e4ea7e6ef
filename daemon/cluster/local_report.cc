// LocalReport: assembled from the store, the parity store, the rebuilder, the participant and the
// remote restore's buffers.
#include "daemon/cluster/local_report.h"

namespace moesnap::daemon::cluster {

LocalReport::LocalReport(const ClusterContext& context, const ClusterStore* store,
                         const ParityStore* parity, const Pool* pool, const Rebuilder* rebuilder,
                         const Participant* participant, const RemoteRestore* remote_restore)
    : context_(context), store_(store), parity_(parity), pool_(pool), rebuilder_(rebuilder),
      participant_(participant), remote_restore_(remote_restore) {}

v1::NodeMemory LocalReport::Memory() const {
  v1::NodeMemory memory;
  memory.set_data_bytes(store_->CommittedBytes());
  memory.set_parity_bytes(parity_->committed_bytes());
  memory.set_in_flight_bytes(store_->InFlightBytes() + parity_->in_flight_bytes());
  memory.set_pool_bytes(pool_->capacity());
  memory.set_restore_buffer_bytes(remote_restore_->buffer_bytes());
  return memory;
}

v1::NodeReport LocalReport::Describe() const {
  v1::NodeReport report;
  report.set_node_id(context_.node_id());
  const std::shared_ptr<const v1::JournalCluster> record = store_->ClusterRecord();
  if (record->has_committed_step()) report.set_latest_committed_step(record->committed_step());
  *report.mutable_memory() = Memory();
  report.set_rebuilding(rebuilder_->behind());
  if (report.rebuilding()) {
    report.set_received_steps(static_cast<uint32_t>(parity_->accumulated_steps()));
  }
  if (std::optional<int64_t> open = participant_->OpenStep()) report.set_open_step(*open);
  return report;
}

}  // namespace moesnap::daemon::cluster
