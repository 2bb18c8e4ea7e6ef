// Which step is durable on every node of the job, decided from what etcd holds: each node's record
// of the steps complete on its disk (durable/<node id>, a DurableRecord) and the step decisions
// (steps/<step>). The newest step that every node of the job's layout (node ids 0 .. node_count-1)
// lists, under this job's config digest, and whose decision is committed. Everything read from
// etcd is untrusted: a record over kMaxDurableRecordBytes, one that does not parse, names another
// node, another config or more than kMaxDurableRecordSteps steps, or lists them out of order, is
// no record. A pure function of the keys, so that every case is tested in-process.
//
// Decisions are dropped from etcd once every node applied a later commit (Coordinator's
// forget_every), but not those from the oldest step any record lists on (ForgetBound), up to
// kMaxSparedDecisions back; so a recorded step's decision is normally there to be read, and a
// listed step at or after the oldest held decision needs its decision there, committed. A listed
// step older than the oldest held decision (spared no longer) was decided and is taken as
// committed: a node drains only steps it committed on etcd's decision.
#ifndef MOESNAP_DAEMON_CLUSTER_DURABLE_RECORDS_H_
#define MOESNAP_DAEMON_CLUSTER_DURABLE_RECORDS_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/cluster/etcd_keys.h"
#include "daemon/durable/job_view.h"
#include "daemon/etcd/etcd_client.h"

namespace moesnap::daemon::cluster {

inline constexpr size_t kMaxDurableRecordBytes = 16 << 10;
inline constexpr int kMaxDurableRecordSteps = 1024;
// The coordinator keeps at most this many steps of decisions for the records' sake.
inline constexpr int64_t kMaxSparedDecisions = 4096;

// The value of node `node_id`'s record: its newest kMaxDurableRecordSteps steps of `steps`
// (oldest first, as DurableDirectory lists them).
std::string DurableRecordValue(uint32_t node_id, uint64_t cluster_digest,
                               const std::vector<int64_t>& steps);

// The steps a record lists, or why it is no record (naming the key).
absl::StatusOr<std::vector<int64_t>> ParseDurableRecord(const etcd::KeyValue& kv, uint32_t node_id,
                                                        uint64_t cluster_digest);

struct JobLayout {
  uint32_t node_count = 0;
  uint64_t cluster_digest = 0;
};

// `records`: the keys under keys.Durables(); `decisions`: those under keys.Steps(), read at the
// same revision.
durable::DurableEverywhere NewestDurableEverywhere(const EtcdKeys& keys, const JobLayout& layout,
                                                   const std::vector<etcd::KeyValue>& records,
                                                   const std::vector<etcd::KeyValue>& decisions);

// The oldest step listed by a valid record of a node of the layout (none when there is none).
std::optional<int64_t> OldestRecordedStep(const EtcdKeys& keys, const JobLayout& layout,
                                          const std::vector<etcd::KeyValue>& records);

// Where the coordinator drops decisions: before `previous` (the committed step every node applied
// before the latest one), but not before the oldest recorded step, unless that is more than
// kMaxSparedDecisions older (a node that stopped recording must not keep every decision forever).
int64_t ForgetBound(int64_t previous, std::optional<int64_t> oldest_recorded);

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_DURABLE_RECORDS_H_
