// An in-process cluster for the unit tests of the deciding units: real participants, coordinators,
// rebuilders, parity stores and data planes (TCP on loopback), with fakes at the seams: the store
// (FakeClusterStore: one region per node whose bytes are a function of node and step), the peer
// client (FakeNetwork: calls go straight to the target node's unit, and the test may cut a node off
// or fail chosen calls), the decision log (FakeDecisionLog: fenced write-once decisions, which the
// test may make unreachable, and whose delivery to a node it may withhold) and the election
// (FakeElection: the test says who leads).
#ifndef MOESNAP_TESTS_DAEMON_CLUSTER_IN_PROCESS_CLUSTER_H_
#define MOESNAP_TESTS_DAEMON_CLUSTER_IN_PROCESS_CLUSTER_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/control.h"
#include "daemon/cluster/coordinator.h"
#include "daemon/cluster/local_report.h"
#include "daemon/cluster/remote_restore.h"
#include "daemon/cluster/participant.h"
#include "daemon/cluster/peer_client.h"
#include "daemon/cluster/rebuild.h"
#include "daemon/cluster/transfer.h"
#include "daemon/cluster_store.h"
#include "daemon/parity_store.h"
#include "daemon/pool.h"

namespace moesnap::daemon::cluster::testing {

// The bytes node `node`'s trainer holds after step `step`; with `kept_bytes`, the first of them
// are the same at every step (a part of the state the steps leave as it is).
std::vector<uint8_t> StateOf(uint32_t node, int64_t step, uint64_t bytes, uint64_t kept_bytes = 0);

class FakeClusterStore final : public ClusterStore {
 public:
  FakeClusterStore(Pool* pool, uint32_t node);

  // The node's trainer captured `step`: one region "state" of `bytes` bytes, StateOf(node, step).
  // With `layouts`, the image's record of the rank (rank = node) carries them as its replica
  // groups. With `kept_bytes`, a region "kept" of that many bytes comes first, captured at step 0
  // whatever `step` is (unchanged since), and "state" holds the rest, if any.
  void Capture(int64_t step, uint64_t bytes, const std::vector<v1::ReplicaGroupStep>& layouts = {},
               uint64_t kept_bytes = 0);
  // The node's trainer restored `step`: its captures after it are dropped, and it takes the
  // steps after it again.
  void Rewind(int64_t step);
  std::vector<int64_t> aborted() const;
  std::vector<int64_t> commits() const;
  // The committed region's bytes.
  std::vector<uint8_t> CommittedBytesOf() const;
  // The bytes `step`'s capture holds (empty: none captured, or older than the committed step).
  std::vector<uint8_t> CapturedStateOf(int64_t step) const;
  // Damages the committed image's byte at `offset` (memory gone bad under a held step).
  void FlipCommittedByte(uint64_t offset);
  // From the next Capture on, "state" is recorded as `regions` regions "state.0", "state.1", ...
  // of equal size (the last shorter) over the same bytes: a rank of many tensors.
  void SplitState(int regions);
  // From the next Capture on, state region i is captured anew at step s only when
  // `recaptured(i, s)` (and at its first capture); otherwise it keeps the step and bytes of the
  // capture that last took it: sparse steps of a rank of many tensors.
  void RecaptureOnly(std::function<bool(int region, int64_t step)> recaptured);
  // What WriteRegion wrote of rank `rank`'s region `region` (empty: nothing), and how many times
  // it wrote it (checked: a write that fails its CRCs does not count).
  std::vector<uint8_t> WrittenOf(uint32_t rank, const std::string& region) const;
  int WritesOf(uint32_t rank, const std::string& region) const;
  // Runs as each WriteRegion starts, on its caller's thread: a test looks at the node from there.
  void BeforeWrite(std::function<void()> hook);

  absl::StatusOr<int64_t> WaitNewNodeCapture(absl::Time deadline) override;
  NodeCapture CaptureOf(int64_t step) const override;
  absl::StatusOr<NodeImage> WaitNodeCaptured(int64_t step, absl::Time deadline) override;
  NodeImage CommittedImage() const override;
  absl::StatusOr<std::vector<std::shared_ptr<PoolBytes>>> CommittedBytesOf(
      const v1::NodeImage& image, absl::Span<const int> positions) const override;
  absl::StatusOr<HeldRegion> CommittedRegion(int64_t step, uint32_t rank,
                                             const std::string& region) const override;
  absl::StatusOr<std::shared_ptr<const v1::JournalCluster>> CommitNodeStep(
      int64_t step, v1::JournalCluster cluster, std::vector<std::string> image_bytes) override;
  void AbortNodeStep(int64_t step, const absl::Status& why) override;
  absl::Status InstallImage(const NodeImage& image, v1::JournalCluster cluster) override;
  void ForgetClusterRecord() override;
  std::shared_ptr<const v1::JournalCluster> ClusterRecord() const override;
  RecordWithBytes ClusterRecordWithBytes() const override;
  uint64_t CommittedBytes() const override;
  uint64_t InFlightBytes() const override;
  // RESOURCE_EXHAUSTED once CommitJournalBound passes the journal size the test set (none: room
  // for any step).
  absl::Status JournalRoomFor(const NodeImage& own, int own_position,
                              const std::vector<std::string>& group_images,
                              uint64_t stripes) const override;
  void SetJournalBytes(std::optional<uint64_t> bytes);
  absl::Status WriteRegion(uint32_t rank, const v1::ImageRegion& stored,
                           const PoolBytes& bytes) override;
  absl::StatusOr<v1::RestoreResponse> RestoreFromRank(
      uint32_t rank, uint32_t source_rank, const std::vector<std::string>& regions) override;
  v1::VerifyResponse Verify(std::optional<int64_t> step) const override;

 private:
  Pool* const pool_;
  const uint32_t node_;
  mutable absl::Mutex mutex_;
  absl::CondVar changed_;
  std::map<int64_t, NodeImage> captured_ ABSL_GUARDED_BY(mutex_);
  std::map<int64_t, std::vector<uint8_t>> captured_state_ ABSL_GUARDED_BY(mutex_);
  std::optional<int64_t> latest_ ABSL_GUARDED_BY(mutex_);  // the step the trainer took last
  std::set<int64_t> offered_ ABSL_GUARDED_BY(mutex_);  // captures WaitNewNodeCapture returned
  NodeImage committed_ ABSL_GUARDED_BY(mutex_);
  std::shared_ptr<const v1::JournalCluster> record_ ABSL_GUARDED_BY(mutex_) =
      std::make_shared<v1::JournalCluster>();
  std::shared_ptr<const std::vector<std::string>> record_bytes_ ABSL_GUARDED_BY(mutex_) =
      std::make_shared<std::vector<std::string>>();
  std::vector<int64_t> aborted_ ABSL_GUARDED_BY(mutex_);
  std::vector<int64_t> commits_ ABSL_GUARDED_BY(mutex_);
  int state_regions_ ABSL_GUARDED_BY(mutex_) = 1;
  std::function<bool(int, int64_t)> recaptured_ ABSL_GUARDED_BY(mutex_);
  std::vector<int64_t> state_steps_ ABSL_GUARDED_BY(mutex_);  // each state region's, last capture
  std::optional<uint64_t> journal_bytes_ ABSL_GUARDED_BY(mutex_);
  struct Written {
    std::vector<uint8_t> bytes;
    int writes = 0;
  };
  std::map<std::pair<uint32_t, std::string>, Written> written_ ABSL_GUARDED_BY(mutex_);
  std::function<void()> before_write_ ABSL_GUARDED_BY(mutex_);
};

// The decision log every node shares.
class FakeDecisionLog final : public DecisionLog {
 public:
  // Who hears of each decision as it is written (the nodes' watches).
  using Listener = std::function<void(const v1::StepDecision&)>;
  void Listen(uint32_t node, Listener listener);
  // The node's watch misses the decisions written from now on until Hear (it must read them).
  void Deafen(uint32_t node);
  void Hear(uint32_t node);
  // The fence: only decisions of this token are written.
  void SetLeaderToken(int64_t token);
  // While unreachable every call fails UNAVAILABLE; CutOff makes it so for one node's calls.
  void SetReachable(bool reachable);
  void CutOff(uint32_t node, bool cut);
  // The log as node `node` reaches it.
  DecisionLog* ViewOf(uint32_t node);
  // Runs before each Decide is written (a test pauses or deposes the coordinator there).
  void BeforeDecide(std::function<void(const v1::StepDecision&)> hook);
  std::map<int64_t, v1::StepDecision> decisions() const;
  int writes() const;

  absl::StatusOr<v1::StepDecision> Decide(const v1::StepDecision& decision) override;
  absl::StatusOr<std::vector<v1::StepDecision>> DecisionsAfter(
      std::optional<int64_t> after) override;
  absl::Status ForgetBefore(int64_t step, int64_t token) override;

 private:
  class NodeView final : public DecisionLog {
   public:
    NodeView(FakeDecisionLog* log, uint32_t node) : log_(log), node_(node) {}
    absl::StatusOr<v1::StepDecision> Decide(const v1::StepDecision& decision) override;
    absl::StatusOr<std::vector<v1::StepDecision>> DecisionsAfter(
        std::optional<int64_t> after) override;
    absl::Status ForgetBefore(int64_t step, int64_t token) override;

   private:
    absl::Status Reach() const;
    FakeDecisionLog* const log_;
    const uint32_t node_;
  };

  mutable absl::Mutex mutex_;
  std::set<uint32_t> cut_off_ ABSL_GUARDED_BY(mutex_);
  std::map<uint32_t, std::unique_ptr<NodeView>> views_ ABSL_GUARDED_BY(mutex_);
  std::map<int64_t, v1::StepDecision> decisions_ ABSL_GUARDED_BY(mutex_);
  std::map<uint32_t, Listener> listeners_ ABSL_GUARDED_BY(mutex_);
  std::set<uint32_t> deaf_ ABSL_GUARDED_BY(mutex_);
  int64_t leader_token_ ABSL_GUARDED_BY(mutex_) = 0;
  bool reachable_ ABSL_GUARDED_BY(mutex_) = true;
  int writes_ ABSL_GUARDED_BY(mutex_) = 0;
  std::function<void(const v1::StepDecision&)> before_decide_ ABSL_GUARDED_BY(mutex_);
};

// Who leads. Elect gives the node a new, higher token; the decision log and the node table follow.
// The nodes' durable records as the coordinator asks them: only the oldest recorded step, which
// the test sets.
class FakeDurableRecords final : public DurableRecords {
 public:
  absl::Status Record(const std::vector<int64_t>&) override {
    return absl::UnimplementedError("not in these tests");
  }
  absl::StatusOr<durable::DurableEverywhere> NewestEverywhere() override {
    return absl::UnimplementedError("not in these tests");
  }
  absl::StatusOr<std::optional<int64_t>> OldestRecorded() override {
    absl::MutexLock lock(&mutex_);
    return oldest_;
  }
  void set_oldest(std::optional<int64_t> step) {
    absl::MutexLock lock(&mutex_);
    oldest_ = step;
  }

 private:
  absl::Mutex mutex_;
  std::optional<int64_t> oldest_ ABSL_GUARDED_BY(mutex_);
};

class FakeElection {
 public:
  FakeElection(FakeDecisionLog* log, NodeTable* nodes) : log_(log), nodes_(nodes) {}
  int64_t Elect(uint32_t node);
  // The leader loses its lease and nobody leads.
  void Depose();
  std::optional<std::pair<uint32_t, int64_t>> leader() const;

  class Candidate final : public Leadership {
   public:
    Candidate(FakeElection* election, uint32_t node) : election_(election), node_(node) {}
    absl::StatusOr<int64_t> Campaign(absl::Duration timeout) override;
    bool Holds(int64_t token) const override;
    void Resign(int64_t token) override;

   private:
    FakeElection* const election_;
    const uint32_t node_;
  };

 private:
  FakeDecisionLog* const log_;
  NodeTable* const nodes_;
  mutable absl::Mutex mutex_;
  absl::CondVar changed_;
  std::optional<uint32_t> leader_ ABSL_GUARDED_BY(mutex_);
  int64_t token_ ABSL_GUARDED_BY(mutex_) = 0;
};

struct NodeUnits;

// Peer calls between the in-process nodes.
class FakeNetwork {
 public:
  void Attach(uint32_t node, NodeUnits* units);
  void Detach(uint32_t node);
  // Calls to and from a cut node fail UNAVAILABLE.
  void Cut(uint32_t node);
  void Heal(uint32_t node);
  // A call for which `filter(from, to, name)` returns an error fails with it (names: "Prepare",
  // "Encode", "Propose", "GroupState", "SendUnits", "DecodeUnits", ...).
  void SetFilter(std::function<absl::Status(uint32_t, uint32_t, const std::string&)> filter);
  // The units that answer a call from `from` to `to`, or why the call fails.
  absl::StatusOr<NodeUnits*> Route(uint32_t from, uint32_t to, const std::string& name);
  // Runs once a SendUnits or DecodeUnits call from `from` to `to` was served (its frames sent),
  // before its answer reaches the caller: a test holds it there (a slow transfer).
  void SetUnitsServed(std::function<void(uint32_t from, uint32_t to)> hook);
  void UnitsServed(uint32_t from, uint32_t to);
  // Rewrites every Encode request from `from` to `to` before it is served (a coordinator that
  // sends a node something other than what it reported).
  using EncodeRewrite = std::function<void(uint32_t from, uint32_t to, v1::EncodeRequest&)>;
  void SetEncodeRewrite(EncodeRewrite rewrite);
  v1::EncodeRequest Rewritten(uint32_t from, uint32_t to, const v1::EncodeRequest& request);
  // Rewrites every answer `to` gives a Prepare from `from` before the caller has it (a node that
  // answers with something other than what it holds).
  using PrepareAnswerRewrite = std::function<void(uint32_t from, uint32_t to, v1::PrepareResponse&)>;
  void SetPrepareAnswerRewrite(PrepareAnswerRewrite rewrite);
  void RewriteAnswer(uint32_t from, uint32_t to, v1::PrepareResponse& response);
  // The proposals a coordinator took (answered without an error), in order, as sent.
  void Proposed(const v1::ProposeRequest& request);
  std::vector<v1::ProposeRequest> proposals() const;

 private:
  mutable absl::Mutex mutex_;
  std::map<uint32_t, NodeUnits*> nodes_ ABSL_GUARDED_BY(mutex_);
  std::set<uint32_t> cut_ ABSL_GUARDED_BY(mutex_);
  std::function<absl::Status(uint32_t, uint32_t, const std::string&)> filter_
      ABSL_GUARDED_BY(mutex_);
  std::function<void(uint32_t, uint32_t)> units_served_ ABSL_GUARDED_BY(mutex_);
  EncodeRewrite encode_rewrite_ ABSL_GUARDED_BY(mutex_);
  PrepareAnswerRewrite prepare_answer_rewrite_ ABSL_GUARDED_BY(mutex_);
  std::vector<v1::ProposeRequest> proposals_ ABSL_GUARDED_BY(mutex_);
};

class FakePeerClient final : public PeerClient {
 public:
  FakePeerClient(uint32_t self, FakeNetwork* network) : self_(self), network_(network) {}
  absl::StatusOr<v1::NodeReport> Describe(uint32_t node) override;
  absl::StatusOr<v1::ProposeResponse> Propose(uint32_t node,
                                              const v1::ProposeRequest& request) override;
  absl::StatusOr<v1::PrepareResponse> Prepare(uint32_t node,
                                              const v1::PrepareRequest& request) override;
  absl::StatusOr<v1::EncodeResponse> Encode(uint32_t node,
                                            const v1::EncodeRequest& request) override;
  absl::StatusOr<v1::GroupStateResponse> GroupState(uint32_t node) override;
  absl::StatusOr<v1::SendUnitsResponse> SendUnits(uint32_t node,
                                                  const v1::SendUnitsRequest& request) override;
  absl::StatusOr<v1::DecodeUnitsResponse> DecodeUnits(
      uint32_t node, const v1::DecodeUnitsRequest& request) override;
  absl::StatusOr<v1::RebuildResponse> Rebuild(uint32_t node) override;
  absl::StatusOr<v1::LocateRankResponse> LocateRank(
      uint32_t node, const v1::LocateRankRequest& request) override;
  absl::StatusOr<v1::FetchLogResponse> FetchLog(uint32_t node,
                                                const v1::FetchLogRequest& request) override;
  absl::StatusOr<v1::DurableStateResponse> DurableState(uint32_t node,
                                                        absl::Time deadline) override;
  uint64_t calls() const override { return calls_; }

 private:
  const uint32_t self_;
  FakeNetwork* const network_;
  std::atomic<uint64_t> calls_{0};
};

// One node's units, as the daemon assembles them, over the fakes.
struct NodeUnits {
  NodeUnits(uint32_t id, const Topology* topology, NodeTable* nodes, FakeNetwork* network,
            FakeDecisionLog* log, FakeElection* election, FakeDurableRecords* records);
  ~NodeUnits();
  // Starts proposing, coordinating when elected, and checking whether the node is behind.
  void Start();

  const uint32_t id;
  const std::string pool_name;
  std::unique_ptr<Pool> pool;
  FakePeerClient peers;
  ClusterContext context;
  FakeClusterStore store;
  ParityStore parity;
  Transfer transfer;
  Rebuilder rebuilder;
  Participant participant;
  FakeElection::Candidate candidate;
  Coordinator coordinator;
  RemoteRestore remote_restore;
  LocalReport report;
};

class InProcessCluster {
 public:
  static constexpr uint64_t kStripeUnitBytes = 64 << 10;
  static constexpr uint32_t kCommitTimeoutMs = 5000;  // cluster.commit_timeout_ms

  // `nodes` nodes in groups of k + m, stripe units of `stripe_unit_bytes`; with `allow_degraded`,
  // steps commit while nodes are lost (cluster.allow_degraded).
  InProcessCluster(int nodes, int data_units, int parity_units, bool allow_degraded = false,
                   uint64_t stripe_unit_bytes = kStripeUnitBytes);
  ~InProcessCluster();

  NodeUnits& node(uint32_t id) { return *nodes_.at(id); }
  int size() const { return static_cast<int>(nodes_.size()); }
  FakeDecisionLog& log() { return log_; }
  FakeNetwork& network() { return network_; }
  FakeElection& election() { return election_; }
  FakeDurableRecords& records() { return records_; }
  NodeTable& table() { return table_; }

  // Every node's trainer captures `step` (`bytes` bytes of state each, the first `kept_bytes` of
  // them unchanged at every step).
  void CaptureEverywhere(int64_t step, uint64_t bytes, uint64_t kept_bytes = 0);
  // Waits until every node in `nodes` (all when empty) has committed `step`.
  bool WaitCommitted(int64_t step, std::vector<uint32_t> nodes = {});
  // Waits until the log holds a decision of `step`.
  std::optional<v1::StepDecision> WaitDecided(int64_t step);
  // Waits until the log has taken `writes` writes (decisions and drops of old ones): a coordinator
  // drops old decisions after the nodes heard of the step that let it.
  bool WaitLogWrites(int writes);
  // Replaces node `id` by a fresh one with empty memory (a lost node and its replacement). With
  // `reached_at`, the other nodes reach its data plane at the port it returns for the replacement's
  // own (a proxy in front of it).
  void Replace(uint32_t id, const std::function<uint16_t(uint16_t)>& reached_at = {});
  // Node `id` is lost: its lease ends (it leaves the node table), no call reaches it or leaves it,
  // and it hears no decision. Its units stay until Replace.
  void Lose(uint32_t id);
  // Decodes every node's committed data from the others' units (a rebuild of each, by a fresh
  // node in its place, without touching the cluster) and compares it with what the node captured
  // at `step` (of `bytes`). Any difference means parity diverged.
  void ExpectEveryNodeRebuildable(int64_t step, uint64_t bytes);

 private:
  std::unique_ptr<const Topology> topology_;
  // Each node's own view (who it is, its group and position); kept while any node may use it.
  std::vector<std::unique_ptr<const Topology>> topologies_;
  NodeTable table_;
  FakeNetwork network_;
  FakeDecisionLog log_;
  FakeElection election_;
  FakeDurableRecords records_;
  std::map<uint32_t, std::unique_ptr<NodeUnits>> nodes_;
};

}  // namespace moesnap::daemon::cluster::testing

#endif  // MOESNAP_TESTS_DAEMON_CLUSTER_IN_PROCESS_CLUSTER_H_
