// Hands every step decision etcd holds to this node's participant, in step order: those present
// when it starts (or when its watch could not resume), then each one as it is written. A node that
// was cut off catches up from etcd this way; it never acts on a decision etcd does not hold.
#ifndef MOESNAP_DAEMON_CLUSTER_DECISION_FEED_H_
#define MOESNAP_DAEMON_CLUSTER_DECISION_FEED_H_

#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cluster/etcd_keys.h"
#include "daemon/cluster/etcd_session.h"
#include "daemon/cluster/participant.h"

namespace moesnap::daemon::cluster {

class DecisionFeed {
 public:
  DecisionFeed(EtcdSession* session, const EtcdKeys& keys, DecisionLog* log,
               Participant* participant);
  ~DecisionFeed();  // stops

  void Start();

 private:
  void Run();
  bool stopping() const;

  EtcdSession* const session_;
  const EtcdKeys keys_;
  DecisionLog* const log_;
  Participant* const participant_;
  mutable absl::Mutex mutex_;
  absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread thread_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_DECISION_FEED_H_
