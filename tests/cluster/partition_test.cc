// A cluster on a network of its own: each moesnapd (one group, k = 4, m = 2) and each etcd member on
// a host that is a network namespace on one bridge (tests/testing/net_lab.h), with real partitions
// (a host's link taken down), real SIGSTOP past a lease, a lost node replaced on another host under
// a host name, and etcd's leader SIGKILLed. Every case ends with the same checks: every node holds
// the same latest committed step, which etcd decided committed; no node holds a step committed that
// etcd decided aborted, or aborted that etcd decided committed; every node can be rebuilt from its
// group; every node's restore equals, byte for byte, what its trainer snapshotted.
//
// These tests make network namespaces, so they need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); without
// them they skip and say why.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/etcd/etcd_client.h"
#include "proto/moesnap.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/etcd_process.h"
#include "tests/testing/job_certificates.h"
#include "tests/testing/net_lab.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::NetLab;
using testing::TestDaemon;
using testing::TestDaemonOptions;
using namespace std::chrono_literals;

constexpr int kNodes = 6;  // one group: k = 4, m = 2
constexpr char kJob[] = "partition-test";
constexpr absl::Duration kSettle = absl::Seconds(60);  // the longest any condition is waited for

// Nodes hold unequal amounts of state (4 + id regions of 100,000 bytes); a step computes for
// `step_ms` before its snapshot.
std::vector<std::string> TrainerArguments(const TestDaemon& daemon, uint32_t node,
                                          const std::string& mode, int64_t steps,
                                          int step_ms = 0) {
  return {BinaryPath("moesnap-test-trainer"), "--socket", daemon.agent_socket(), "--rank",
          std::to_string(node), "--mode", mode, "--regions", std::to_string(4 + node),
          "--region-bytes", "100000", "--steps", std::to_string(steps), "--step-ms",
          std::to_string(step_ms)};
}

class PartitionTest : public ::testing::Test {
 protected:
  explicit PartitionTest(int etcd_members = 1) : etcd_members_(etcd_members) {}

  void SetUp() override {
    if (const std::string why = NetLab::Unavailable(); !why.empty()) GTEST_SKIP() << why;
    // Hosts: the etcd members, then one per node, then a spare for a replacement.
    absl::StatusOr<std::unique_ptr<NetLab>> lab = NetLab::Create(etcd_members_ + kNodes + 1);
    ASSERT_TRUE(lab.ok()) << lab.status();
    lab_ = *std::move(lab);
    // Mutual TLS everywhere, as in production: peers and etcd (its certificate names the
    // members' lab addresses).
    std::vector<std::string> etcd_addresses;
    for (int member = 0; member < etcd_members_; ++member) {
      etcd_addresses.insert(etcd_addresses.end(), {"--etcd-ip", lab_->address(member)});
    }
    absl::StatusOr<std::unique_ptr<testing::JobCertificates>> certificates =
        testing::JobCertificates::Make(kJob, kNodes, etcd_addresses);
    ASSERT_TRUE(certificates.ok()) << certificates.status();
    certificates_ = *std::move(certificates);
    testing::EtcdCluster::Options etcd_options{.members = etcd_members_};
    certificates_->ServeEtcd(&etcd_options);
    for (int member = 0; member < etcd_members_; ++member) {
      etcd_options.placements.push_back(
          {.address = lab_->address(member), .launcher = lab_->Launch(member, {})});
    }
    absl::StatusOr<std::unique_ptr<testing::EtcdCluster>> etcd =
        testing::EtcdCluster::Start(etcd_options);
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = *std::move(etcd);
    absl::StatusOr<std::unique_ptr<etcd::Client>> client =
        etcd::Client::Create(etcd_->ClientOptions());
    ASSERT_TRUE(client.ok()) << client.status();
    etcd_client_ = *std::move(client);
    for (int node = 0; node < kNodes; ++node) {
      host_of_.push_back(etcd_members_ + node);
      daemons_.push_back(MakeDaemon(node, lab_->address(host_of_[node])));
    }
    // Node 0 first, so that it coordinates.
    ASSERT_TRUE(daemons_[0]->Start());
    ASSERT_NO_FATAL_FAILURE(WaitForCoordinator(0));
    for (int node = 1; node < kNodes; ++node) ASSERT_TRUE(daemons_[node]->Start());
    ASSERT_NO_FATAL_FAILURE(WaitForCluster());
  }

  void TearDown() override {
    StopTraining();
    for (auto& daemon : daemons_) {
      if (daemon) daemon->Resume();  // a paused daemon must be able to die
    }
    daemons_.clear();
    retired_.clear();
    etcd_client_.reset();
    etcd_.reset();
    lab_.reset();  // after every process in it
    certificates_.reset();
  }

  // A daemon of node `node` on lab host `host_of_[node]`, advertising `address` (an IP address or
  // a host name of the lab).
  std::unique_ptr<TestDaemon> MakeDaemon(int node, const std::string& address) {
    const std::string config = absl::StrCat(
        "[cluster]\njob = \"", kJob, "\"\nnode_count = ", kNodes,
        "\ndata_units = 4\nparity_units = 2\nstripe_unit_bytes = \"256KiB\"\n",
        "lease_ttl_ms = 2000\ncommit_timeout_ms = 3000\netcd_endpoints = [\"",
        absl::StrJoin(etcd_->endpoints(), "\", \""), "\"]\nadvertise_host = \"", address, "\"\n",
        certificates_->TlsSection());
    auto daemon = std::make_unique<TestDaemon>(TestDaemonOptions{
        .pool_bytes = "64MiB", .node_id = static_cast<uint32_t>(node), .extra_config = config});
    daemon->set_launcher(lab_->Launch(host_of_[node], {}));
    return daemon;
  }

  v1::ClusterStatusResponse Status(int node) {
    auto stub = v1::Admin::NewStub(grpc::CreateChannel("unix:" + daemons_[node]->admin_socket(),
                                                       grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 5s);
    v1::ClusterStatusResponse response;
    const grpc::Status status = stub->ClusterStatus(&context, {}, &response);
    EXPECT_TRUE(status.ok()) << "node " << node << ": " << status.error_message();
    return response;
  }

  // Waits for `condition` (polled), failing with `what` after kSettle.
  template <typename Condition>
  void WaitFor(const std::string& what, Condition condition) {
    const absl::Time deadline = absl::Now() + kSettle;
    while (!condition()) {
      ASSERT_LT(absl::Now(), deadline) << "waited " << absl::FormatDuration(kSettle) << " for "
                                       << what;
      std::this_thread::sleep_for(50ms);
    }
  }

  // Waits until every node sees every node live, answering and not rebuilding.
  void WaitForCluster() {
    WaitFor("every node to see the whole cluster live", [&] {
      for (int node = 0; node < kNodes; ++node) {
        int seen = 0;
        const v1::ClusterStatusResponse status = Status(node);
        for (const v1::ClusterNodeStatus& peer : status.nodes()) {
          if (peer.live() && peer.answered() && !peer.rebuilding()) ++seen;
        }
        if (seen != kNodes) return false;
      }
      return true;
    });
  }

  // The coordinator as node `asking` sees it (-1: none).
  int Coordinator(int asking) {
    const v1::ClusterStatusResponse status = Status(asking);
    for (const v1::ClusterNodeStatus& peer : status.nodes()) {
      if (peer.coordinator()) return static_cast<int>(peer.node_id());
    }
    return -1;
  }

  void WaitForCoordinator(int node) {
    WaitFor(absl::StrCat("node ", node, " to coordinate"), [&] { return Coordinator(node) == node; });
  }

  int64_t Committed(int node) { return Status(node).latest_committed_step(); }

  // Starts a trainer per node that trains until it is stopped, a step every 100 ms: a commit
  // (tens of ms here) is in flight much of the time, and a stall of seconds captures tens of steps,
  // which the pools hold.
  void StartTraining() {
    for (int node = 0; node < kNodes; ++node) {
      trainers_.push_back(std::make_unique<ChildProcess>(
          TrainerArguments(*daemons_[node], node, "train", 1000000, 100)));
    }
  }
  // SIGKILLs the trainers (their daemons see the connections go; captures in flight end). None
  // may have ended before: no fault of the snapshot system stops training.
  void StopTraining() {
    for (size_t node = 0; node < trainers_.size(); ++node) {
      ChildProcess& trainer = *trainers_[node];
      if (trainer.running()) {
        trainer.Kill(SIGKILL);
        continue;
      }
      std::string output;
      while (std::optional<std::string> line = trainer.ReadLine(100ms)) output += *line + "\n";
      ADD_FAILURE() << "the trainer of node " << node << " ended (" << trainer.Wait(0ms).value_or(-1)
                    << "); its last lines:\n" << output.substr(output.size() > 2000 ? output.size() - 2000 : 0);
    }
    trainers_.clear();
  }

  // Waits until every node in `nodes` committed a step after `step`.
  void WaitForCommitAfter(int64_t step, const std::vector<int>& nodes) {
    WaitFor(absl::StrCat("a step after ", step, " to commit"), [&] {
      for (int node : nodes) {
        if (Committed(node) <= step) return false;
      }
      return true;
    });
  }

  // Trains every node to `steps`, each trainer waiting for its last step to commit.
  void TrainAll(int64_t steps) {
    std::vector<std::unique_ptr<ChildProcess>> trainers;
    for (int node = 0; node < kNodes; ++node) {
      trainers.push_back(std::make_unique<ChildProcess>(
          TrainerArguments(*daemons_[node], node, "train", steps)));
    }
    for (int node = 0; node < kNodes; ++node) {
      std::string last, output;
      while (std::optional<std::string> line = trainers[node]->ReadLine(120s)) {
        last = *line;
        absl::StrAppend(&output, *line, "\n");
      }
      EXPECT_EQ(last, absl::StrCat("done ", steps)) << "trainer of node " << node << ":\n" << output;
      EXPECT_EQ(trainers[node]->Wait(10s), 0) << "trainer of node " << node;
    }
  }

  // A fresh trainer restores node `node` and compares every byte; returns the step.
  int64_t VerifiedStep(int node) {
    ChildProcess verify(TrainerArguments(*daemons_[node], node, "verify", 0));
    int64_t step = -1;
    std::string output;
    while (std::optional<std::string> line = verify.ReadLine(120s)) {
      absl::StrAppend(&output, *line, "\n");
      if (absl::StartsWith(*line, "verified step ")) {
        EXPECT_TRUE(absl::SimpleAtoi(line->substr(14), &step));
      }
    }
    EXPECT_EQ(verify.Wait(10s), 0) << "node " << node << ": " << output;
    return step;
  }

  // Every decision etcd holds for the job: step -> (decision, its key's create revision).
  std::map<int64_t, std::pair<v1::StepDecision, int64_t>> Decisions() {
    std::map<int64_t, std::pair<v1::StepDecision, int64_t>> decisions;
    absl::StatusOr<etcd::RangeResult> read =
        etcd_client_->GetPrefix(absl::StrCat("/moesnap/", kJob, "/steps/"));
    EXPECT_TRUE(read.ok()) << read.status();
    if (!read.ok()) return decisions;
    for (const etcd::KeyValue& kv : read->kvs) {
      v1::StepDecision decision;
      EXPECT_TRUE(decision.ParseFromString(kv.value)) << kv.key;
      EXPECT_EQ(kv.version, 1) << kv.key << " was written more than once";
      decisions[decision.step()] = {decision, kv.create_revision};
    }
    return decisions;
  }

  // The checks every case ends with (see the top of the file); the trainers are stopped first.
  void ExpectConsistentAndRestorable() {
    StopTraining();
    // Steps in flight when the trainers stopped are decided by the coordinator's timeout at most.
    int64_t step = -1;
    WaitFor("every node to hold the same latest committed step", [&] {
      step = Committed(0);
      for (int node = 1; node < kNodes; ++node) {
        if (Committed(node) != step) return false;
      }
      return true;
    });
    ASSERT_GT(step, 0);
    const auto decisions = Decisions();
    ASSERT_TRUE(decisions.count(step)) << "no decision of step " << step << " in etcd";
    EXPECT_TRUE(decisions.at(step).first.committed()) << "step " << step;
    for (const auto& [decided, entry] : decisions) {
      if (decided > step) {
        EXPECT_FALSE(entry.first.committed()) << "step " << decided << " committed in etcd";
      }
    }
    for (int node = 0; node < kNodes; ++node) {
      auto stub = v1::Admin::NewStub(grpc::CreateChannel(
          "unix:" + daemons_[node]->admin_socket(), grpc::InsecureChannelCredentials()));
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + 10s);
      v1::ListStepsResponse held;
      ASSERT_TRUE(stub->ListSteps(&context, {}, &held).ok()) << "node " << node;
      for (const v1::StepInfo& info : held.steps()) {
        const auto decision = decisions.find(info.step());
        if (info.state() == v1::STEP_STATE_COMMITTED) {
          EXPECT_LE(info.step(), step) << "node " << node;
          if (decision != decisions.end()) {
            EXPECT_TRUE(decision->second.first.committed())
                << "node " << node << " holds step " << info.step() << " committed; etcd aborted it";
          }
        }
        if (info.state() == v1::STEP_STATE_ABORTED && decision != decisions.end()) {
          EXPECT_FALSE(decision->second.first.committed())
              << "node " << node << " aborted step " << info.step() << "; etcd committed it";
        }
      }
    }
    // Every node rebuilt from its group (as an operator would, from another node), then restored,
    // once every node is live again: one whose lease lapsed while etcd had no leader registers
    // anew, and a rebuild of a node etcd holds lost is refused.
    WaitForCluster();
    for (int node = 0; node < kNodes; ++node) {
      auto stub = v1::Admin::NewStub(grpc::CreateChannel(
          "unix:" + daemons_[(node + 1) % kNodes]->admin_socket(),
          grpc::InsecureChannelCredentials()));
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + 60s);
      v1::RebuildRequest request;
      request.set_node_id(node);
      v1::RebuildResponse rebuilt;
      const grpc::Status status = stub->Rebuild(&context, request, &rebuilt);
      ASSERT_TRUE(status.ok()) << "rebuild of node " << node << ": " << status.error_message();
      EXPECT_EQ(rebuilt.step(), step) << "node " << node;
    }
    for (int node = 0; node < kNodes; ++node) EXPECT_EQ(VerifiedStep(node), step) << "node " << node;
  }

  const int etcd_members_;
  std::unique_ptr<NetLab> lab_;
  std::unique_ptr<testing::EtcdCluster> etcd_;
  std::unique_ptr<testing::JobCertificates> certificates_;
  std::unique_ptr<etcd::Client> etcd_client_;
  std::vector<int> host_of_;  // node -> lab host
  std::vector<std::unique_ptr<TestDaemon>> daemons_;
  std::vector<std::unique_ptr<TestDaemon>> retired_;  // replaced daemons, kept for their files
  std::vector<std::unique_ptr<ChildProcess>> trainers_;
};

TEST_F(PartitionTest, CoordinatorCutOffMidCommitIsReplacedAndRejoinsWhenHealed) {
  StartTraining();
  ASSERT_NO_FATAL_FAILURE(WaitForCommitAfter(2, {0, 1, 2, 3, 4, 5}));
  const int old_coordinator = Coordinator(1);
  ASSERT_GE(old_coordinator, 0);
  const int64_t old_token = Status(1).coordinator_token();
  const int survivor = (old_coordinator + 1) % kNodes;
  // Trainers snapshot without pause, so a commit is in flight now.
  ASSERT_TRUE(lab_->Disconnect(host_of_[old_coordinator]).ok());
  ASSERT_NO_FATAL_FAILURE(WaitFor("another node to coordinate", [&] {
    const int now = Coordinator(survivor);
    return now >= 0 && now != old_coordinator;
  }));
  EXPECT_GT(Status(survivor).coordinator_token(), old_token);
  // Cut off, the old coordinator can no longer decide: nothing it holds commits past what etcd has.
  const int64_t before_heal = Committed(survivor);
  ASSERT_TRUE(lab_->Reconnect(host_of_[old_coordinator]).ok());
  ASSERT_NO_FATAL_FAILURE(WaitForCluster());
  ASSERT_NO_FATAL_FAILURE(WaitForCommitAfter(before_heal, {0, 1, 2, 3, 4, 5}));
  EXPECT_NE(Coordinator(old_coordinator), old_coordinator);
  ExpectConsistentAndRestorable();
}

TEST_F(PartitionTest, CoordinatorPausedPastItsLeaseIsDeposedAndItsLateDecisionsFail) {
  StartTraining();
  ASSERT_NO_FATAL_FAILURE(WaitForCommitAfter(2, {0, 1, 2, 3, 4, 5}));
  const int old_coordinator = Coordinator(1);
  ASSERT_GE(old_coordinator, 0);
  const int64_t old_token = Status(1).coordinator_token();
  const int survivor = (old_coordinator + 1) % kNodes;
  ASSERT_TRUE(daemons_[old_coordinator]->Pause());
  ASSERT_NO_FATAL_FAILURE(WaitFor("another node to coordinate", [&] {
    const int now = Coordinator(survivor);
    return now >= 0 && now != old_coordinator;
  }));
  const int64_t new_token = Status(survivor).coordinator_token();
  ASSERT_GT(new_token, old_token);
  // The old coordinator's leader key is gone by this revision of etcd (the new one leads).
  absl::StatusOr<etcd::RangeResult> now = etcd_client_->GetPrefix(absl::StrCat("/moesnap/", kJob));
  ASSERT_TRUE(now.ok()) << now.status();
  const int64_t deposed_by = now->revision;
  daemons_[old_coordinator]->Resume();
  // It learns it was deposed: it names the new coordinator and its token.
  ASSERT_NO_FATAL_FAILURE(WaitFor("the old coordinator to learn it was deposed", [&] {
    const v1::ClusterStatusResponse status = Status(old_coordinator);
    return status.coordinator_token() == new_token && Coordinator(old_coordinator) != old_coordinator;
  }));
  ASSERT_NO_FATAL_FAILURE(WaitForCluster());
  ASSERT_NO_FATAL_FAILURE(WaitForCommitAfter(Committed(survivor), {0, 1, 2, 3, 4, 5}));
  // Whatever the old coordinator tried to decide after it woke was refused: etcd holds no decision
  // under its token written after it was deposed.
  for (const auto& [step, entry] : Decisions()) {
    if (entry.first.token() == old_token) {
      EXPECT_LT(entry.second, deposed_by) << "step " << step << " decided by a deposed coordinator";
    }
  }
  ExpectConsistentAndRestorable();
}

TEST_F(PartitionTest, LostNodeIsReplacedByADaemonOnAnotherHostUnderAHostName) {
  TrainAll(4);
  const int lost = 2;
  daemons_[lost]->Kill(SIGKILL);
  daemons_[lost]->DiscardPool();
  retired_.push_back(std::move(daemons_[lost]));
  const int spare = etcd_members_ + kNodes;
  host_of_[lost] = spare;
  daemons_[lost] = MakeDaemon(lost, lab_->hostname(spare));
  ASSERT_TRUE(daemons_[lost]->Start());
  ASSERT_NO_FATAL_FAILURE(WaitForCluster());
  // Every node finds the replacement at its new address, under its host name.
  for (int node = 0; node < kNodes; ++node) {
    const v1::ClusterNodeStatus peer = Status(node).nodes(lost);
    EXPECT_EQ(peer.host(), lab_->hostname(spare)) << "as node " << node << " sees it";
  }
  EXPECT_EQ(VerifiedStep(lost), 4);  // rebuilt from the group
  // The replacement takes part in commits: parity goes to and comes from its new address.
  TrainAll(7);
  for (int node = 0; node < kNodes; ++node) EXPECT_EQ(Committed(node), 7) << "node " << node;
  ExpectConsistentAndRestorable();
}

class EtcdLeaderLossTest : public PartitionTest {
 protected:
  EtcdLeaderLossTest() : PartitionTest(3) {}
};

TEST_F(EtcdLeaderLossTest, EtcdLeaderKilledDuringCommitsLosesNoDecision) {
  StartTraining();
  ASSERT_NO_FATAL_FAILURE(WaitForCommitAfter(2, {0, 1, 2, 3, 4, 5}));
  absl::StatusOr<int> leader = etcd_->Leader();
  ASSERT_TRUE(leader.ok()) << leader.status();
  const int64_t before = Committed(0);
  ASSERT_TRUE(etcd_->Kill(*leader).ok());
  // The two members left elect a leader and the job commits on through them.
  ASSERT_NO_FATAL_FAILURE(WaitForCommitAfter(before + 2, {0, 1, 2, 3, 4, 5}));
  ExpectConsistentAndRestorable();
}

}  // namespace
}  // namespace moesnap
