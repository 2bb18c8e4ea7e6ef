// CheckGroupShards: every member's layout at the step, looked up by rank across the nodes.
#include "daemon/cluster/group_shards.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/shard_layout.h"

namespace moesnap::daemon::cluster {

absl::Status CheckGroupShards(int64_t step, const std::map<uint32_t, v1::NodeImage>& images) {
  // Each rank's record and the node it came from (a rank on two nodes: the first is kept; the
  // check then fails on whichever layout disagrees).
  std::map<uint32_t, std::pair<uint32_t, const v1::JournalRank*>> records;
  for (const auto& [node, image] : images) {
    for (const v1::JournalRank& record : image.ranks()) records.try_emplace(record.rank(), node, &record);
  }
  // The layouts checked already: every member of a group names the same one, checked once.
  std::map<std::string, const v1::ReplicaGroup*> checked;
  for (const auto& [rank, held] : records) {
    for (const v1::ReplicaGroupStep& layout : held.second->replica_groups()) {
      if (layout.step() != step) continue;
      const v1::ReplicaGroup& group = layout.group();
      if (auto seen = checked.find(group.name());
          seen != checked.end() && SameMembers(*seen->second, group)) {
        continue;
      }
      checked[group.name()] = &group;
      // Captured by name: clang before 16 cannot capture structured bindings.
      const auto where = [&group, of_rank = rank, on_node = held.first] {
        return absl::StrCat("replica group '", group.name(), "' (ranks [",
                            absl::StrJoin(group.ranks(), ", "), "]) of rank ", of_rank, " on node ",
                            on_node, ": ");
      };
      for (uint32_t member : group.ranks()) {
        auto found = records.find(member);
        if (found == records.end()) {
          return absl::FailedPreconditionError(absl::StrCat(
              where(), "no node holds a record of member rank ", member, " at step ", step));
        }
        const auto& [node, record] = found->second;
        const v1::ReplicaGroupStep* theirs = nullptr;
        for (const v1::ReplicaGroupStep& other : record->replica_groups()) {
          if (other.group().name() == group.name()) theirs = &other;
        }
        if (theirs == nullptr || theirs->step() != step || !SameMembers(theirs->group(), group)) {
          return absl::FailedPreconditionError(absl::StrCat(
              where(), "member rank ", member, " on node ", node, " holds ",
              theirs == nullptr
                  ? std::string("no shard of the group")
                  : absl::StrCat("its shard of step ", theirs->step(), " with ranks [",
                                 absl::StrJoin(theirs->group().ranks(), ", "), "]"),
              ", not of step ", step, " (its trainer did not capture it)"));
        }
      }
    }
  }
  return absl::OkStatus();
}

std::map<uint32_t, uint32_t> RankHolders(const v1::JournalCluster& record) {
  std::map<uint32_t, uint32_t> holders;
  for (const v1::NodeImage& image : record.group_images()) {
    for (const v1::JournalRank& rank : image.ranks()) holders[rank.rank()] = image.node_id();
    for (const v1::ImageRegion& region : image.regions()) holders[region.rank()] = image.node_id();
  }
  return holders;
}

}  // namespace moesnap::daemon::cluster
