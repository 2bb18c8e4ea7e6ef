// The metrics read from the daemon's existing views when Prometheus scrapes: the store's status
// (pool bytes, ranks, journal), exited trainers' memory kept for their ranks, the upstream log, the
// cluster's nodes (peer connectivity, rebuilds) and the long operations running. Counters and
// histograms updated on hot paths are registered by their own units (store, journal, services,
// cluster); this adds the rest.
#ifndef MOESNAP_DAEMON_DAEMON_METRICS_H_
#define MOESNAP_DAEMON_DAEMON_METRICS_H_

#include "common/metrics.h"
#include "daemon/cluster/cluster.h"
#include "daemon/durable/restore_tiers.h"
#include "daemon/store.h"
#include "daemon/trainer_memory.h"
#include "daemon/upstream_log.h"

namespace moesnap::daemon {

// `cluster` is null on a single node. The collector runs until the handle is destroyed, which
// must happen before any of the views it reads.
[[nodiscard]] metrics::CollectorHandle CollectDaemonMetrics(metrics::Registry& registry, Store* store,
                                                            TrainerSessions* sessions,
                                                            UpstreamLog* log, Cluster* cluster,
                                                            durable::RestoreTiers* tiers);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_DAEMON_METRICS_H_
