// LogForwarding: ask every other live node; keep the fullest log found.
#include "daemon/cluster/log_forwarding.h"

#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cluster/parallel.h"

namespace moesnap::daemon::cluster {

LogForwarding::LogForwarding(const ClusterContext& context, UpstreamLog* log)
    : context_(context), log_(log) {}

absl::StatusOr<v1::FetchLogResponse> LogForwarding::FetchLocal(
    const v1::FetchLogRequest& request) {
  return log_->Fetch(request);
}

absl::StatusOr<v1::FetchLogResponse> LogForwarding::FetchRemote(
    const v1::FetchLogRequest& request) {
  // The trainer does not know where its neighbour ran: ask every other live node; the one that
  // holds the rank's log answers, the others say NOT_FOUND.
  std::vector<uint32_t> nodes;
  std::vector<uint32_t> lost;
  for (uint32_t id : context_.nodes->Ids()) {
    if (id == context_.node_id()) continue;
    (context_.nodes->Live(id) ? nodes : lost).push_back(id);
  }
  absl::Mutex found_mutex;
  std::optional<absl::StatusOr<v1::FetchLogResponse>> found;
  const std::vector<absl::Status> statuses = InParallel(nodes, [&](uint32_t id) -> absl::Status {
    absl::StatusOr<v1::FetchLogResponse> response = context_.peers->FetchLog(id, request);
    if (absl::IsNotFound(response.status()) || absl::IsUnavailable(response.status())) {
      return response.status();
    }
    absl::MutexLock lock(&found_mutex);
    // A node that ran the rank once may hold an older, emptier log than the one it runs on now.
    if (response.ok() && (!found || !found->ok() ||
                          response->records_size() > (*found)->records_size())) {
      found = *std::move(response);
      return absl::OkStatus();
    }
    if (!found) found = response.status();
    return response.status();
  });
  if (found) return *std::move(found);
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (absl::IsUnavailable(statuses[i])) lost.push_back(nodes[i]);
  }
  return absl::NotFoundError(absl::StrCat(
      "no live node holds an upstream log of rank ", request.rank(),
      lost.empty() ? std::string()
                   : absl::StrCat(" (nodes [", absl::StrJoin(lost, ", "),
                                  "] are lost or did not answer; a log held there is gone)")));
}

}  // namespace moesnap::daemon::cluster
