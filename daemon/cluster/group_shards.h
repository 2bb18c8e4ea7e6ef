// The cross-node half of a replica group's commit rule (REFT): a step commits only when every
// member of each replica group a rank captured at it holds its shard at that very step. Members
// run on several nodes, so no node can tell alone: the coordinator checks the nodes' prepared
// images, whose rank records carry each rank's replica-group layouts and the step of each.
#ifndef MOESNAP_DAEMON_CLUSTER_GROUP_SHARDS_H_
#define MOESNAP_DAEMON_CLUSTER_GROUP_SHARDS_H_

#include <cstdint>
#include <map>

#include "absl/status/status.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

// OK when, for every rank record in `images` (node id -> the node's image of `step`) whose layout
// of a group was taken at `step`, every member of that layout has a record whose layout of the
// group was taken at `step` with the same members. FAILED_PRECONDITION naming the group, the
// member and what its node holds otherwise: committed, the step would leave the group's pieces at
// two steps (a member's trainer died, or its node lost its state), and no restore could assemble
// it.
absl::Status CheckGroupShards(int64_t step, const std::map<uint32_t, v1::NodeImage>& images);

// Which node's committed image holds each rank's state (rank -> node id), from a node's record of
// its group: the ranks of the group's nodes, for `moesnapctl inspect` to say where each member's
// shard is.
std::map<uint32_t, uint32_t> RankHolders(const v1::JournalCluster& record);

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_GROUP_SHARDS_H_
