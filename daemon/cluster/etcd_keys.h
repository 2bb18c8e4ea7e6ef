// Where a job's control state lives in etcd, under /moesnap/<job>/:
//   members/<node id>   MemberRecord of the daemon holding that node id, under its lease
//   leader/<node id>    the election's candidate keys (the oldest one leads; its create revision is
//                       the fencing token)
//   steps/<step>        StepDecision, written once; steps are zero-padded so keys sort as steps do
//   durable/<node id>   DurableRecord: the steps complete on that node's disk, under no lease
#ifndef MOESNAP_DAEMON_CLUSTER_ETCD_KEYS_H_
#define MOESNAP_DAEMON_CLUSTER_ETCD_KEYS_H_

#include <cstdint>
#include <optional>
#include <string>

namespace moesnap::daemon::cluster {

class EtcdKeys {
 public:
  explicit EtcdKeys(const std::string& job) : root_("/moesnap/" + job + "/") {}

  std::string Members() const { return root_ + "members/"; }
  std::string Member(uint32_t node_id) const;
  // The election's prefix (without the trailing '/', as etcd::Election takes it).
  std::string Leader() const { return root_ + "leader"; }
  std::string Steps() const { return root_ + "steps/"; }
  std::string Step(int64_t step) const;
  std::string Durables() const { return root_ + "durable/"; }
  std::string Durable(uint32_t node_id) const;

  // The node id of a member key, the step of a step key, the node id of a durable record's key, or
  // the node id of a candidate's name; nullopt for anything else.
  std::optional<uint32_t> MemberOf(const std::string& key) const;
  std::optional<uint32_t> DurableOf(const std::string& key) const;
  std::optional<int64_t> StepOf(const std::string& key) const;
  static std::optional<uint32_t> NodeOfCandidate(const std::string& name);

 private:
  const std::string root_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_ETCD_KEYS_H_
