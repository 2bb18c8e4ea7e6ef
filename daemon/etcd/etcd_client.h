// moesnap's etcd v3 client: key-value reads and writes, transactions with compares (enough for a
// fenced write-once decision), leases kept alive in the background, watches that resume where they
// stopped, compaction. election.h builds a leader election with a fencing token on top of it.
//
// Ownership and threads. A Client owns one gRPC channel per endpoint; every method of Client is
// thread-safe and may be called from any number of threads at once. LeaseKeeper and Watcher each
// own one background thread and share the client's channels (they keep them alive, so they may
// outlive the Client); their methods are thread-safe too. Destroying a keeper or watcher stops its
// thread within one attempt_timeout. No gRPC or generated type appears in this header.
//
// Failover. Each call goes first to the endpoint that answered last. When an endpoint's connection
// fails (refused, or its TLS handshake or name resolution) or is not made within dial_timeout, or
// an attempt fails in a way that says nothing of the outcome, the next endpoint becomes the
// preferred one. Calls that may safely run twice (reads, lease grants and keep-alives, revokes,
// compaction, status, watches) move on to the next endpoint until call_timeout. Put, Delete and Txn
// move on only while the request provably never reached a server (no connection, or the member
// answered "no leader" before proposing it); after an attempt that may have been applied they fail
// with kUnavailable and say the outcome is unknown. WriteOnce may always be retried, since a second
// attempt finds the first one's key, and it does so by itself.
//
// Every request requires the member to have a raft leader (etcd's "hasleader" metadata), so a
// member cut off from its quorum refuses at once instead of serving stale reads or hanging.
//
// Errors are absl::Status; messages name the call, the key and the endpoints tried. etcd's own
// errors keep their gRPC code: kOutOfRange for a compacted or future revision, kNotFound for an
// unknown lease, kInvalidArgument for a malformed request. kDeadlineExceeded: call_timeout passed
// before any endpoint answered. kUnavailable: every endpoint failed, or a write's outcome is
// unknown.
#ifndef MOESNAP_DAEMON_ETCD_ETCD_CLIENT_H_
#define MOESNAP_DAEMON_ETCD_ETCD_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moesnap::etcd {

namespace internal {
class Endpoints;
}  // namespace internal

// Transport security. All empty: plaintext. ca_file alone: TLS that checks the members'
// certificates against that CA. cert_file with key_file as well: mutual TLS (etcd's
// --client-cert-auth).
struct TlsOptions {
  std::string ca_file{};    // PEM bundle of the CA(s) that signed the members' certificates
  std::string cert_file{};  // PEM certificate chain this client presents
  std::string key_file{};   // PEM private key of cert_file
};

struct Options {
  // "host:port" of each etcd member's client URL; tried in this order.
  std::vector<std::string> endpoints{};
  // Bound on one method call of Client, every failover included.
  absl::Duration call_timeout = absl::Seconds(5);
  // Bound on one request to one endpoint; then the next endpoint is tried (where that is safe).
  absl::Duration attempt_timeout = absl::Seconds(2);
  // Bound on establishing a connection to one endpoint before the next one is tried (an endpoint
  // whose connection failed, refused or its TLS handshake or name resolution, is left at once).
  absl::Duration dial_timeout = absl::Seconds(1);
  TlsOptions tls{};
};

// One key as etcd stores it. Revisions are the store's global revision counter: create_revision is
// the revision that created the key (0: the key does not exist), mod_revision the one that last
// changed it, version the number of changes since creation (1 after the create).
struct KeyValue {
  std::string key{};
  std::string value{};
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t version = 0;
  int64_t lease = 0;  // 0: no lease
};

// Options of a prefix read.
struct RangeOptions {
  enum class Order { kKey, kCreateAscending, kCreateDescending };
  Order order = Order::kKey;
  int64_t limit = 0;                // at most this many keys (0: all)
  int64_t max_create_revision = 0;  // only keys created at or before this revision (0: any)
  int64_t revision = 0;             // read the store as of this revision (0: now)
};

struct RangeResult {
  std::vector<KeyValue> kvs{};  // in the order asked for
  int64_t revision = 0;         // the store's revision when the read was served
  bool more = false;            // a limit left keys out
};

struct DeleteResult {
  int64_t deleted = 0;   // keys deleted
  int64_t revision = 0;  // the store's revision after the delete
};

// One predicate of a transaction, on one key. Absent keys have every number 0 and an empty value.
struct Compare {
  enum class Target { kValue, kVersion, kCreateRevision, kModRevision };
  enum class Relation { kEqual, kNotEqual, kLess, kGreater };
  std::string key{};
  Target target = Target::kCreateRevision;
  Relation relation = Relation::kEqual;
  int64_t number = 0;   // for kVersion, kCreateRevision, kModRevision
  std::string value{};  // for kValue

  static Compare Absent(std::string key);  // create revision == 0
  static Compare CreateRevision(std::string key, Relation relation, int64_t revision);
  static Compare ModRevision(std::string key, Relation relation, int64_t revision);
  static Compare Version(std::string key, Relation relation, int64_t version);
  static Compare Value(std::string key, Relation relation, std::string value);
};

// One operation of a transaction branch.
struct Operation {
  enum class Kind { kGet, kPut, kDelete };
  Kind kind = Kind::kGet;
  std::string key{};
  bool prefix = false;  // kGet, kDelete: every key that starts with `key`
  std::string value{};  // kPut
  int64_t lease = 0;    // kPut: attach the key to this lease (0: none)
  std::string range_end{};  // kDelete without prefix: every key in [key, range_end) when set

  static Operation Get(std::string key);
  static Operation GetPrefix(std::string prefix);
  static Operation Put(std::string key, std::string value, int64_t lease = 0);
  static Operation Delete(std::string key);
  static Operation DeletePrefix(std::string prefix);
  static Operation DeleteRange(std::string key, std::string range_end);
};

// The result of one operation, in the order of the branch that ran.
struct OperationResult {
  std::vector<KeyValue> kvs{};  // kGet
  int64_t deleted = 0;          // kDelete
};

struct TxnRequest {
  std::vector<Compare> compares{};  // all must hold for `on_success` to run
  std::vector<Operation> on_success{};
  std::vector<Operation> on_failure{};
  // True when applying the transaction twice changes nothing the first application did not (its
  // compares guard every write, as in a write-once put or a delete of a given create revision): the
  // client then resends it to another endpoint after an attempt whose outcome is unknown.
  bool safe_to_retry = false;
};

struct TxnResult {
  bool succeeded = false;                  // every compare held, so on_success ran
  int64_t revision = 0;                    // the store's revision after the transaction
  std::vector<OperationResult> results{};  // one per operation of the branch that ran
};

// A write is fenced by a key: it applies only while `key` has this create revision, i.e. has not
// been deleted (its lease expired, or it was resigned) since. An election's leader key and its
// revision (the fencing token) make one.
struct Fence {
  std::string key{};
  int64_t create_revision = 0;
};

struct Lease {
  int64_t id = 0;
  int64_t ttl_seconds = 0;  // as granted; etcd may raise a request to its minimum
};

// What one etcd member says of itself.
struct MemberStatus {
  std::string endpoint{};  // the endpoint that answered
  uint64_t member_id = 0;
  uint64_t leader_id = 0;  // 0: the member knows no leader
  uint64_t raft_term = 0;
  int64_t revision = 0;
  std::string version{};  // etcd's version, e.g. "3.4.23"
};

struct WatchEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  // The key after the event; for kDelete only key and mod_revision (the delete's revision) are set.
  KeyValue kv{};
};

// Keeps a lease alive in the background: renews it every third of its TTL, and reports the lease
// lost once etcd says it expired or was revoked, or once a whole TTL passed without a renewal (then
// the lease may still exist on etcd, but nothing can rely on it). Loss is final: the keeper stops.
class LeaseKeeper {
 public:
  ~LeaseKeeper();  // stops renewing; does not revoke
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  int64_t lease_id() const;
  // OK while the lease is held; once lost, why (kNotFound: expired or revoked on etcd;
  // kUnavailable: not renewed within its TTL).
  absl::Status status() const;
  // Waits until the lease is lost or `timeout` passes; true if lost.
  bool WaitLost(absl::Duration timeout) const;
  // Renewals etcd confirmed so far.
  int64_t renewals() const;

  class Impl;

 private:
  friend class Client;
  static std::unique_ptr<LeaseKeeper> Start(std::shared_ptr<internal::Endpoints> endpoints,
                                            const Lease& lease,
                                            std::function<void(const absl::Status&)> on_lost);
  explicit LeaseKeeper(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Delivers the events of a key or prefix in revision order, from a start revision on. The stream is
// re-created on another endpoint after a failure (a member killed, stopped or cut off from its
// quorum) from the revision after the last one delivered, so no event is lost or delivered twice.
// If etcd compacted that revision away meanwhile, Next fails with kOutOfRange for good: the caller
// reads the state again and watches from the read's revision + 1.
class Watcher {
 public:
  ~Watcher();
  Watcher(const Watcher&) = delete;
  Watcher& operator=(const Watcher&) = delete;

  // The next event; kDeadlineExceeded if none came within `timeout`; kOutOfRange once the revisions
  // still needed were compacted.
  absl::StatusOr<WatchEvent> Next(absl::Duration timeout);
  // The first revision not yet delivered by Next.
  int64_t next_revision() const;
  // How many times the stream was re-created after a failure.
  int64_t resumes() const;

  class Impl;

 private:
  friend class Client;
  static std::unique_ptr<Watcher> Start(std::shared_ptr<internal::Endpoints> endpoints,
                                        std::string key, bool prefix, int64_t start_revision);
  explicit Watcher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class Client {
 public:
  // Checks the options and reads the TLS files; connects lazily, so etcd may be down at creation.
  static absl::StatusOr<std::unique_ptr<Client>> Create(const Options& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const Options& options() const;

  // Key-value. Reads are linearizable. `revision` in results is the store's revision after the
  // call.
  absl::StatusOr<std::optional<KeyValue>> Get(const std::string& key);
  absl::StatusOr<RangeResult> GetPrefix(const std::string& prefix,
                                        const RangeOptions& options = {});
  // Returns the revision of the write.
  absl::StatusOr<int64_t> Put(const std::string& key, const std::string& value, int64_t lease = 0);
  absl::StatusOr<DeleteResult> Delete(const std::string& key);
  absl::StatusOr<DeleteResult> DeletePrefix(const std::string& prefix);
  absl::StatusOr<TxnResult> Txn(const TxnRequest& request);

  // Writes `value` to `key` unless the key exists, and, with a fence, only while the fence holds.
  // Returns the key as stored: this value, or the one an earlier writer left (compare values to
  // know which; equal values are the same decision). kFailedPrecondition if the key is absent and
  // the fence no longer holds, naming the fence key's revision found. Retried by itself after
  // ambiguous failures.
  absl::StatusOr<KeyValue> WriteOnce(const std::string& key, const std::string& value,
                                     const std::optional<Fence>& fence = std::nullopt,
                                     int64_t lease = 0);

  // Leases. `ttl` is rounded up to whole seconds.
  absl::StatusOr<Lease> GrantLease(absl::Duration ttl);
  // One renewal; returns the TTL etcd granted. kNotFound if the lease expired or was revoked.
  absl::StatusOr<int64_t> KeepAliveOnce(int64_t lease_id);
  // Revokes the lease and deletes its keys. A lease that is already gone is not an error.
  absl::Status RevokeLease(int64_t lease_id);
  // Starts renewing `lease` in the background, at once and then every third of its TTL; call it
  // right after GrantLease, since the keeper counts the TTL from its own start. `on_lost`, if
  // given, runs once on the keeper's thread when the lease is lost (not when the keeper is
  // destroyed), before status() and WaitLost report it, and must not destroy the keeper.
  absl::StatusOr<std::unique_ptr<LeaseKeeper>> KeepAlive(
      const Lease& lease, std::function<void(const absl::Status&)> on_lost = nullptr);

  // Watches. start_revision >= 1 is the first revision delivered (a read's revision + 1 continues
  // right after that read).
  absl::StatusOr<std::unique_ptr<Watcher>> WatchKey(const std::string& key, int64_t start_revision);
  absl::StatusOr<std::unique_ptr<Watcher>> WatchPrefix(const std::string& prefix,
                                                       int64_t start_revision);

  // Discards the history before `revision` (reads and watches at older revisions then fail with
  // kOutOfRange). Compacting at or below an earlier compaction is not an error.
  absl::Status Compact(int64_t revision);

  // The status of the first member that answers.
  absl::StatusOr<MemberStatus> Status();

 private:
  explicit Client(std::shared_ptr<internal::Endpoints> endpoints);
  std::shared_ptr<internal::Endpoints> endpoints_;
};

// The end of etcd's key range holding every key that starts with `prefix`: the prefix with its last
// byte below 0xff incremented and what follows dropped; "\0" (every key) if no byte can be.
std::string PrefixRangeEnd(const std::string& prefix);

}  // namespace moesnap::etcd

#endif  // MOESNAP_DAEMON_ETCD_ETCD_CLIENT_H_
