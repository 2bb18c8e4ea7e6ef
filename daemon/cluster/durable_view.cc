// DurableView: this node's memory for its peers, theirs asked in parallel, durable steps in etcd.
#include "daemon/cluster/durable_view.h"

#include <numeric>
#include <vector>

#include "daemon/cluster/parallel.h"

namespace moesnap::daemon::cluster {

absl::Status DurableView::WaitMemory(absl::Time deadline) {
  return rebuilder_->WaitRestorable(deadline);
}

void DurableView::StateLoaded() { rebuilder_->StateReplaced(); }

absl::StatusOr<durable::DurableEverywhere> DurableView::NewestDurableEverywhere(
    const std::vector<int64_t>&) {
  return records_->NewestEverywhere();
}

absl::Status DurableView::RecordDurable(const std::vector<int64_t>& here) {
  return records_->Record(here);
}

absl::StatusOr<v1::DurableStateResponse> DurableView::Local() const {
  v1::DurableStateResponse response;
  response.set_node_id(context_.node_id());
  // Settled once the rebuild at start has ended; its memory serves when that found nothing to
  // rebuild or rebuilt it, and a step is committed.
  response.set_settled(!rebuilder_->rebuilding());
  const std::shared_ptr<const v1::JournalCluster> record = store_->ClusterRecord();
  if (!rebuilder_->behind() && record->has_committed_step()) {
    response.set_memory_step(record->committed_step());
  }
  return response;
}

durable::MemorySurvey DurableView::SurveyMemory(absl::Time deadline) {
  std::vector<uint32_t> peers;
  for (uint32_t id : context_.nodes->Ids()) {
    if (id != context_.node_id()) peers.push_back(id);
  }
  std::vector<size_t> indices(peers.size());
  std::iota(indices.begin(), indices.end(), 0);
  std::vector<v1::DurableStateResponse> answers(peers.size());
  const std::vector<absl::Status> statuses = InParallel(indices, [&](size_t i) {
    absl::StatusOr<v1::DurableStateResponse> answer = context_.peers->DurableState(peers[i], deadline);
    if (answer.ok()) answers[i] = *std::move(answer);
    return answer.status();
  });
  durable::MemorySurvey survey;
  for (size_t i = 0; i < peers.size(); ++i) {
    if (!statuses[i].ok()) {
      survey.silent[peers[i]] = std::string(statuses[i].message());
      continue;
    }
    durable::NodeMemory& node = survey.answered.emplace_back();
    node.node_id = peers[i];
    if (answers[i].has_memory_step()) node.memory_step = answers[i].memory_step();
    node.settled = answers[i].settled();
  }
  return survey;
}

}  // namespace moesnap::daemon::cluster
