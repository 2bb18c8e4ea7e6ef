// Leader election on etcd with a fencing token, as etcd's own concurrency recipe does it: each
// candidate creates the key <prefix>/<name> under its lease; the leader is the candidate whose key
// has the lowest create revision; the fencing token is that create revision. A leader that loses
// its lease (crash, pause, partition past the TTL) loses its key, so the next candidate leads with
// a higher token, and every write fenced by the old key's revision (Client::WriteOnce with
// leadership.fence()) fails from then on, even if the old leader still believes it leads.
//
// Ownership and threads: an Election refers to a Client that must outlive it; it holds no other
// state, and its methods are thread-safe.
#ifndef MOESNAP_DAEMON_ETCD_ELECTION_H_
#define MOESNAP_DAEMON_ETCD_ELECTION_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/etcd/etcd_client.h"

namespace moesnap::etcd {

// A candidate's key while it leads.
struct Leadership {
  std::string key{};  // <prefix>/<name>
  int64_t token = 0;  // the key's create revision: higher for every later leader
  int64_t lease = 0;
  Fence fence() const { return Fence{.key = key, .create_revision = token}; }
};

// The current leader as anyone sees it.
struct Leader {
  std::string name{};  // the part of the key after <prefix>/
  KeyValue kv{};       // kv.value: what the leader published; kv.create_revision: its token
  int64_t token() const { return kv.create_revision; }
  Fence fence() const { return Fence{.key = kv.key, .create_revision = kv.create_revision}; }
};

class Election {
 public:
  // Candidates' keys are `prefix` + "/" + name.
  Election(Client& client, std::string prefix);

  // Enters `name` as a candidate with `value` (e.g. its address) under `lease`, and waits until it
  // leads, or `timeout` passes (kDeadlineExceeded: still a candidate, its key stays; call Campaign
  // again to go on waiting, or Resign). If the key exists under another lease (a previous life of
  // this candidate, perhaps still running), waits for it to go first. kAborted if this candidate's
  // key vanished while it waited (its lease was lost).
  absl::StatusOr<Leadership> Campaign(const std::string& name, const std::string& value,
                                      int64_t lease, absl::Duration timeout);

  // The candidate that leads now, if any.
  absl::StatusOr<std::optional<Leader>> CurrentLeader();

  // Deletes the candidate's key if it still is the one of `leadership`; a key that is gone already
  // is not an error.
  absl::Status Resign(const Leadership& leadership);

  const std::string& prefix() const { return prefix_; }

 private:
  // Finds this candidate's key, or creates it when absent (a re-entry writes nothing); waits
  // while a key of another lease holds the name.
  absl::StatusOr<KeyValue> Enter(const std::string& key, const std::string& value, int64_t lease,
                                 absl::Time deadline);
  // Waits until `key` is deleted (watching from `from_revision`), or `deadline`.
  absl::Status WaitDeleted(const std::string& key, int64_t from_revision, absl::Time deadline);

  Client& client_;
  const std::string prefix_;
};

}  // namespace moesnap::etcd

#endif  // MOESNAP_DAEMON_ETCD_ELECTION_H_
