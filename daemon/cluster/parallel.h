// Fan-out for the cluster's calls to many peers at once.
#ifndef MOESNAP_DAEMON_CLUSTER_PARALLEL_H_
#define MOESNAP_DAEMON_CLUSTER_PARALLEL_H_

#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace moesnap::daemon::cluster {

// Runs `call` for every item on its own thread (one item: on the caller's) and returns the
// statuses in order.
template <typename Item, typename Call>
std::vector<absl::Status> InParallel(const std::vector<Item>& items, Call call) {
  if (items.size() == 1) return {call(items[0])};
  std::vector<absl::Status> statuses(items.size());
  std::vector<std::thread> threads;
  threads.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    threads.emplace_back([&, i] { statuses[i] = call(items[i]); });
  }
  for (std::thread& thread : threads) thread.join();
  return statuses;
}

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_PARALLEL_H_
