// NewestDurableEverywhere: valid records intersected, then the newest common step whose decision
// is committed.
#include "daemon/cluster/durable_records.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {
namespace {

// Lists at most this many problems in a reason; the rest are counted.
constexpr size_t kMaxNamed = 8;

std::string JoinBounded(const std::vector<std::string>& items) {
  std::vector<std::string> named(items.begin(),
                                 items.begin() + static_cast<long>(std::min(items.size(), kMaxNamed)));
  std::string joined = absl::StrJoin(named, "; ");
  if (items.size() > kMaxNamed) absl::StrAppend(&joined, "; and ", items.size() - kMaxNamed, " more");
  return joined;
}

}  // namespace

std::string DurableRecordValue(uint32_t node_id, uint64_t cluster_digest,
                               const std::vector<int64_t>& steps) {
  v1::DurableRecord record;
  record.set_node_id(node_id);
  record.set_cluster_digest(cluster_digest);
  const size_t first = steps.size() > kMaxDurableRecordSteps ? steps.size() - kMaxDurableRecordSteps : 0;
  for (size_t i = first; i < steps.size(); ++i) record.add_steps(steps[i]);
  return record.SerializeAsString();
}

absl::StatusOr<std::vector<int64_t>> ParseDurableRecord(const etcd::KeyValue& kv, uint32_t node_id,
                                                        uint64_t cluster_digest) {
  if (kv.value.size() > kMaxDurableRecordBytes) {
    return absl::DataLossError(absl::StrCat("etcd key ", kv.key, " holds ", kv.value.size(),
                                            " bytes, more than the ", kMaxDurableRecordBytes,
                                            " a record of durable steps may have"));
  }
  v1::DurableRecord record;
  if (!record.ParseFromString(kv.value)) {
    return absl::DataLossError(absl::StrCat("etcd key ", kv.key,
                                            " does not hold a record of durable steps"));
  }
  if (record.node_id() != node_id) {
    return absl::DataLossError(absl::StrCat("etcd key ", kv.key, " holds the record of node ",
                                            record.node_id(), ", not of node ", node_id));
  }
  if (record.cluster_digest() != cluster_digest) {
    return absl::FailedPreconditionError(absl::StrCat(
        "etcd key ", kv.key, " was written under another cluster config (digest ",
        absl::Hex(record.cluster_digest()), ", this job's is ", absl::Hex(cluster_digest), ")"));
  }
  if (record.steps_size() > kMaxDurableRecordSteps) {
    return absl::DataLossError(absl::StrCat("etcd key ", kv.key, " lists ", record.steps_size(),
                                            " steps, more than the ", kMaxDurableRecordSteps,
                                            " a record may list"));
  }
  for (int i = 1; i < record.steps_size(); ++i) {
    if (record.steps(i) <= record.steps(i - 1)) {
      return absl::DataLossError(absl::StrCat("etcd key ", kv.key, " lists step ",
                                              record.steps(i), " after step ", record.steps(i - 1),
                                              " (steps must be listed oldest first, once each)"));
    }
  }
  return std::vector<int64_t>(record.steps().begin(), record.steps().end());
}

std::optional<int64_t> OldestRecordedStep(const EtcdKeys& keys, const JobLayout& layout,
                                          const std::vector<etcd::KeyValue>& records) {
  std::optional<int64_t> oldest;
  for (const etcd::KeyValue& kv : records) {
    const std::optional<uint32_t> id = keys.DurableOf(kv.key);
    if (!id || *id >= layout.node_count) continue;
    absl::StatusOr<std::vector<int64_t>> steps = ParseDurableRecord(kv, *id, layout.cluster_digest);
    if (steps.ok() && !steps->empty()) oldest = std::min(oldest.value_or(steps->front()), steps->front());
  }
  return oldest;
}

int64_t ForgetBound(int64_t previous, std::optional<int64_t> oldest_recorded) {
  if (!oldest_recorded || *oldest_recorded >= previous) return previous;
  // previous - kMaxSparedDecisions cannot overflow for any step a job reaches; clamp anyway.
  const int64_t floor = previous < std::numeric_limits<int64_t>::min() + kMaxSparedDecisions
                            ? std::numeric_limits<int64_t>::min()
                            : previous - kMaxSparedDecisions;
  return std::max(*oldest_recorded, floor);
}

durable::DurableEverywhere NewestDurableEverywhere(const EtcdKeys& keys, const JobLayout& layout,
                                                   const std::vector<etcd::KeyValue>& records,
                                                   const std::vector<etcd::KeyValue>& decisions) {
  std::map<uint32_t, std::vector<int64_t>> listed;
  std::vector<std::string> problems;
  for (const etcd::KeyValue& kv : records) {
    const std::optional<uint32_t> id = keys.DurableOf(kv.key);
    if (!id || *id >= layout.node_count) continue;  // not a node of this layout
    absl::StatusOr<std::vector<int64_t>> steps =
        ParseDurableRecord(kv, *id, layout.cluster_digest);
    if (!steps.ok()) {
      problems.push_back(std::string(steps.status().message()));
      continue;
    }
    listed[*id] = *std::move(steps);
  }
  std::vector<uint32_t> missing;
  for (uint32_t id = 0; id < layout.node_count; ++id) {
    if (!listed.contains(id)) missing.push_back(id);
  }
  if (layout.node_count == 0 || !missing.empty()) {
    std::vector<std::string> named;
    for (size_t i = 0; i < missing.size() && i < kMaxNamed; ++i) named.push_back(absl::StrCat(missing[i]));
    std::string reason = absl::StrCat(
        "no valid record of durable steps from node", missing.size() > 1 ? "s " : " ",
        absl::StrJoin(named, ", "), missing.size() > kMaxNamed ? absl::StrCat(" and ", missing.size() - kMaxNamed, " more") : "");
    if (!problems.empty()) absl::StrAppend(&reason, " (", JoinBounded(problems), ")");
    return {std::nullopt, reason};
  }
  std::set<int64_t> common(listed.begin()->second.begin(), listed.begin()->second.end());
  for (const auto& [id, steps] : listed) {
    std::set<int64_t> kept;
    std::set_intersection(common.begin(), common.end(), steps.begin(), steps.end(),
                          std::inserter(kept, kept.begin()));
    common = std::move(kept);
  }
  if (common.empty()) {
    return {std::nullopt, "no step is listed in the record of every node"};
  }
  // Decisions: committed, aborted, or unreadable (nullopt); the oldest step etcd still holds one of.
  std::map<int64_t, std::optional<bool>> decided;
  std::optional<int64_t> oldest_held;
  for (const etcd::KeyValue& kv : decisions) {
    const std::optional<int64_t> step = keys.StepOf(kv.key);
    if (!step) continue;
    oldest_held = std::min(oldest_held.value_or(*step), *step);
    v1::StepDecision decision;
    if (kv.value.size() <= kMaxDurableRecordBytes && decision.ParseFromString(kv.value) &&
        decision.step() == *step) {
      decided[*step] = decision.committed();
    } else {
      decided[*step] = std::nullopt;
    }
  }
  std::vector<std::string> passed_over;
  for (auto it = common.rbegin(); it != common.rend(); ++it) {
    const int64_t step = *it;
    const auto found = decided.find(step);
    if (found == decided.end()) {
      if (oldest_held && step < *oldest_held) {
        return {step, absl::StrCat("the newest step in every node's record of durable steps in etcd",
                                   " (decided before step ", *oldest_held,
                                   ", the oldest decision etcd still holds)")};
      }
      passed_over.push_back(absl::StrCat("step ", step, " has no decision in etcd"));
    } else if (!found->second) {
      passed_over.push_back(absl::StrCat("the decision of step ", step, " cannot be read"));
    } else if (!*found->second) {
      passed_over.push_back(absl::StrCat("step ", step, " was aborted"));
    } else {
      return {step, absl::StrCat("the newest step in every node's record of durable steps in etcd",
                                 " and committed", passed_over.empty() ? "" : " (",
                                 JoinBounded(passed_over), passed_over.empty() ? "" : ")")};
    }
  }
  return {std::nullopt, absl::StrCat("no step listed by every node is committed: ",
                                     JoinBounded(passed_over))};
}

}  // namespace moesnap::daemon::cluster
