// A cluster on loopback: real moesnapd processes (one group, k = 4, m = 2) and a real etcd, a real
// trainer per node, real SIGKILL. Every case ends in bytes: each node's restored state must equal
// what its trainer snapshotted, whichever daemons were killed and replaced with fresh memory.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "moesnap/client.h"
#include "moesnap/placement_planner.h"
#include "proto/moesnap.grpc.pb.h"
#include "daemon/etcd/etcd_client.h"
#include "daemon/journal.h"
#include "tests/testing/deterministic_bytes.h"
#include "tests/testing/child_process.h"
#include "tests/testing/etcd_process.h"
#include "tests/testing/http_client.h"
#include "tests/testing/job_certificates.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::TestDaemon;
using testing::TestDaemonOptions;
using namespace std::chrono_literals;

constexpr int kDataUnits = 4;
constexpr int kParityUnits = 2;
constexpr int kGroupSize = kDataUnits + kParityUnits;

// Nodes hold unequal amounts of state (4 + id regions of 200,000 bytes), so stripes mix full,
// short and virtually empty units.
std::vector<std::string> TrainerArguments(const TestDaemon& daemon, uint32_t node,
                                          const std::string& mode, int64_t steps) {
  return {BinaryPath("moesnap-test-trainer"), "--socket", daemon.agent_socket(), "--rank",
          std::to_string(node), "--mode", mode, "--regions", std::to_string(4 + node),
          "--region-bytes", "200000", "--steps", std::to_string(steps)};
}

struct CtlResult {
  int exit_code;
  std::string output;  // stdout and stderr
};

CtlResult Ctl(const TestDaemon& daemon, std::vector<std::string> arguments) {
  arguments.insert(arguments.begin(), {BinaryPath("moesnapctl"), "--socket", daemon.admin_socket()});
  ChildProcess ctl(arguments, {}, ChildProcess::Stderr::kCapture);
  CtlResult result{-1, ""};
  while (std::optional<std::string> line = ctl.ReadLine(60s)) result.output += *line + "\n";
  result.exit_code = ctl.Wait(30s).value_or(-1);
  return result;
}

// Overwrites one byte of a daemon's pool file behind its back.
void FlipPoolByte(const TestDaemon& daemon, uint64_t offset) {
  std::fstream pool("/dev/shm/" + daemon.pool_name() + ".data",
                    std::ios::in | std::ios::out | std::ios::binary);
  pool.seekg(offset);
  const char byte = static_cast<char>(pool.get());
  pool.seekp(offset);
  pool.put(static_cast<char>(byte ^ 0x5a));
}

class ClusterTest : public ::testing::Test {
 protected:
  // `extra_config` is appended to every node's config, `cluster_keys` to its [cluster] section.
  explicit ClusterTest(int nodes = kGroupSize, std::string extra_config = "",
                       std::string cluster_keys = "")
      : nodes_(nodes), extra_config_(std::move(extra_config)),
        cluster_keys_(std::move(cluster_keys)) {}

  // Extra environment of node `node`'s daemon (fault injection).
  virtual std::vector<std::string> EnvironmentOf(int /*node*/) { return {}; }

  // Mutual TLS everywhere, as in production: the daemons' peers and etcd, with certificates made
  // by deploy/make-certs.sh.
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<testing::JobCertificates>> certificates =
        testing::JobCertificates::Make("cluster-test", nodes_);
    ASSERT_TRUE(certificates.ok()) << certificates.status();
    certificates_ = *std::move(certificates);
    testing::EtcdCluster::Options etcd_options;
    certificates_->ServeEtcd(&etcd_options);
    absl::StatusOr<std::unique_ptr<testing::EtcdCluster>> etcd =
        testing::EtcdCluster::Start(etcd_options);
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = *std::move(etcd);
    // A lost node is noticed after its lease: the shortest etcd keeps, so that tests run quickly.
    const std::string cluster = absl::StrCat(
        "[cluster]\njob = \"cluster-test\"\nnode_count = ", nodes_, "\ndata_units = ", kDataUnits,
        "\nparity_units = ", kParityUnits, "\nstripe_unit_bytes = \"256KiB\"\n",
        "lease_ttl_ms = 2000\ncommit_timeout_ms = 10000\netcd_endpoints = [\"",
        absl::StrJoin(etcd_->endpoints(), "\", \""), "\"]\nadvertise_host = \"127.0.0.1\"\n",
        "control_port = 0\ndata_port = 0\n",
        // Restores of more than 5 regions of 200000 bytes go in more than one batch.
        "restore_buffer_bytes = \"1MiB\"\n", cluster_keys_);
    for (int id = 0; id < nodes_; ++id) {
      daemons_.push_back(std::make_unique<TestDaemon>(TestDaemonOptions{
          .pool_bytes = "64MiB",
          .journal_bytes = journal_bytes_,
          .node_id = static_cast<uint32_t>(id),
          .extra_config = cluster + certificates_->TlsSection() + extra_config_}));
    }
    // Node 0 first, so that it is the first candidate and coordinates.
    ASSERT_TRUE(daemons_[0]->Start(EnvironmentOf(0)));
    WaitForCoordinator(0);
    for (int id = 1; id < nodes_; ++id) ASSERT_TRUE(daemons_[id]->Start(EnvironmentOf(id)));
    ASSERT_NO_FATAL_FAILURE(WaitForCluster(nodes_));
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

  // Waits until every running node sees `live` nodes live and answering and, when `settled`, not
  // rebuilding (a replaced node's old daemon stays live until its lease ends, but does not
  // answer). The bound is in time, not attempts: a status call is slow on a loaded machine. Fails
  // naming what each node saw.
  void WaitForNodes(int live, bool settled) {
    const auto deadline = std::chrono::steady_clock::now() + 120s;
    std::string views;
    while (std::chrono::steady_clock::now() < deadline) {
      bool reached = true;
      views.clear();
      for (int node = 0; node < nodes_; ++node) {
        if (!daemons_[node]->running()) continue;
        int seen = 0;
        std::vector<std::string> missing;
        const v1::ClusterStatusResponse status = Status(node);
        for (const v1::ClusterNodeStatus& peer : status.nodes()) {
          if (peer.live() && peer.answered() && (!settled || !peer.rebuilding())) {
            ++seen;
          } else {
            missing.push_back(absl::StrCat(peer.node_id(), peer.live() ? "" : " not live",
                                           peer.answered() ? "" : " not answering",
                                           peer.rebuilding() ? " rebuilding" : ""));
          }
        }
        reached = reached && seen == live;
        absl::StrAppend(&views, "\n  node ", node, " counts ", seen, "; not counted: ",
                        missing.empty() ? "none" : absl::StrJoin(missing, ", "));
      }
      if (reached) return;
      std::this_thread::sleep_for(100ms);
    }
    FAIL() << "the cluster did not reach " << live << (settled ? " settled" : " live")
           << " nodes:" << views;
  }
  void WaitForCluster(int live) { WaitForNodes(live, /*settled=*/true); }
  void WaitForLive(int live) { WaitForNodes(live, /*settled=*/false); }

  // Waits until every running node reports the same latest committed step (a node applies a
  // decision from etcd a moment after the others may have) and returns it; fails naming what each
  // node reports if they do not agree.
  int64_t AgreedCommittedStep() {
    std::string views;
    for (int attempt = 0; attempt < 300; ++attempt) {
      std::set<int64_t> steps;
      views.clear();
      for (int node = 0; node < nodes_; ++node) {
        if (!daemons_[node]->running()) continue;
        const v1::ClusterStatusResponse status = Status(node);
        steps.insert(status.has_latest_committed_step() ? status.latest_committed_step() : -1);
        absl::StrAppend(&views, "\n  node ", node, ": latest committed ",
                        status.has_latest_committed_step()
                            ? absl::StrCat(status.latest_committed_step()) : "none",
                        ", last abort: ", status.last_abort(), ", rebuild error: ",
                        status.rebuild_error());
      }
      if (steps.size() == 1) return *steps.begin();
      std::this_thread::sleep_for(100ms);
    }
    ADD_FAILURE() << "the nodes do not agree on the latest committed step:" << views;
    return -1;
  }

  // Waits until node `node` coordinates, as node `node` sees it.
  void WaitForCoordinator(int node) {
    for (int attempt = 0; attempt < 300; ++attempt) {
      const v1::ClusterStatusResponse status = Status(node);
      for (const v1::ClusterNodeStatus& peer : status.nodes()) {
        if (peer.coordinator() && peer.node_id() == static_cast<uint32_t>(node)) return;
      }
      std::this_thread::sleep_for(50ms);
    }
    FAIL() << "node " << node << " never coordinated";
  }

  // The node that coordinates, as node `asking` sees it.
  int Coordinator(int asking) {
    const v1::ClusterStatusResponse status = Status(asking);
    for (const v1::ClusterNodeStatus& peer : status.nodes()) {
      if (peer.coordinator()) return static_cast<int>(peer.node_id());
    }
    return -1;
  }

  // Trains every node to `steps`, each trainer waiting for its last step to commit.
  void TrainAll(int64_t steps) {
    std::vector<std::unique_ptr<ChildProcess>> trainers;
    for (int node = 0; node < nodes_; ++node) {
      trainers.push_back(std::make_unique<ChildProcess>(
          TrainerArguments(*daemons_[node], node, "train", steps)));
    }
    for (int node = 0; node < nodes_; ++node) {
      std::string last, output;
      while (std::optional<std::string> line = trainers[node]->ReadLine(120s)) {
        last = *line;
        absl::StrAppend(&output, *line, "\n");
      }
      EXPECT_EQ(last, absl::StrCat("done ", steps)) << "trainer of node " << node << ":\n" << output;
      EXPECT_EQ(trainers[node]->Wait(10s), 0) << "trainer of node " << node;
    }
  }

  // Restores `regions` of `rank`, as trained by TrainAll(5), into a new rank on `node` in one call,
  // and compares every byte. Rank r ran on node r; `decoded` says whether its group decoded them.
  void RestoreOnto(int node, uint32_t rank, const std::vector<int>& regions, uint32_t new_rank,
                   bool decoded) {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.socket_path = daemons_[node]->agent_socket(), .rank = new_rank});
    ASSERT_TRUE(client.ok()) << client.status();
    std::vector<std::string> names;
    std::vector<std::shared_ptr<SharedBuffer>> buffers;
    for (int region : regions) {
      names.push_back(absl::StrCat("layer", region / 8, ".expert", region % 8, ".master"));
      absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = (*client)->AllocateHost(200000);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      ASSERT_TRUE(
          (*client)->RegisterHostRegion({names.back(), "uint8", {200000}}, *buffer, 0, 200000).ok());
      buffers.push_back(*buffer);
    }
    absl::StatusOr<RestoreResult> restored = (*client)->RestoreFrom(rank, names);
    ASSERT_TRUE(restored.ok()) << "rank " << rank << " " << absl::StrJoin(names, ",")
                               << " onto node " << node << ": " << restored.status();
    EXPECT_EQ(restored->step, 5);
    EXPECT_EQ(restored->source_node, rank);
    EXPECT_EQ(restored->decoded, decoded) << "rank " << rank;
    for (size_t i = 0; i < regions.size(); ++i) {
      std::vector<uint8_t> expected(200000);
      testing::DeterministicBytes(uint64_t{rank} << 48 ^ uint64_t(regions[i]) << 32 ^ 5)
          .Fill(expected.data(), expected.size());
      EXPECT_EQ(std::memcmp(buffers[i]->data(), expected.data(), expected.size()), 0)
          << "rank " << rank << " " << names[i] << " restored onto node " << node;
    }
  }

  // A fresh trainer process restores node `node` and compares every byte; returns the step, and
  // with `tier` where the restore came from ("memory" or "durable").
  int64_t VerifiedStep(int node, std::string* tier = nullptr) {
    ChildProcess verify(TrainerArguments(*daemons_[node], node, "verify", 0));
    int64_t step = -1;
    std::string output;
    while (std::optional<std::string> line = verify.ReadLine(120s)) {
      absl::StrAppend(&output, *line, "\n");
      if (absl::StartsWith(*line, "verified step ")) {
        EXPECT_TRUE(absl::SimpleAtoi(line->substr(14), &step));
      }
      if (absl::StartsWith(*line, "tier ") && tier != nullptr) *tier = line->substr(5);
    }
    EXPECT_EQ(verify.Wait(10s), 0) << "node " << node << ": " << output;
    return step;
  }

  // SIGKILLs the daemon of `node` and starts a replacement with the same id and empty memory.
  void Replace(int node) {
    daemons_[node]->Kill(SIGKILL);
    daemons_[node]->WaitExit(10s);
    daemons_[node]->DiscardPool();
  }

  const int nodes_;
  std::string extra_config_;  // a derived fixture may set it in its constructor
  std::string journal_bytes_ = "1MiB";  // so may it this
  const std::string cluster_keys_;
  std::unique_ptr<testing::JobCertificates> certificates_;
  std::unique_ptr<testing::EtcdCluster> etcd_;
  std::vector<std::unique_ptr<TestDaemon>> daemons_;
};

// Steps commit while nodes are lost (cluster.allow_degraded), the lost nodes named in each decision.
class DegradedClusterTest : public ClusterTest {
 protected:
  DegradedClusterTest() : ClusterTest(kGroupSize, "", "allow_degraded = true\n") {}

  // Waits until every running node sees node `lost` lost (its lease ended).
  void WaitForLost(int lost) {
    for (int attempt = 0; attempt < 600; ++attempt) {
      bool seen = true;
      for (int node = 0; node < nodes_ && seen; ++node) {
        if (daemons_[node]->running()) seen = !Status(node).nodes(lost).live();
      }
      if (seen) return;
      std::this_thread::sleep_for(50ms);
    }
    FAIL() << "node " << lost << " is still live for some node";
  }

  // The committed steps' decisions etcd holds, by step.
  std::map<int64_t, v1::StepDecision> CommittedDecisions() {
    std::map<int64_t, v1::StepDecision> decisions;
    absl::StatusOr<std::unique_ptr<etcd::Client>> client =
        etcd::Client::Create(etcd_->ClientOptions());
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return decisions;
    absl::StatusOr<etcd::RangeResult> read = (*client)->GetPrefix("/moesnap/cluster-test/steps/");
    EXPECT_TRUE(read.ok()) << read.status();
    if (!read.ok()) return decisions;
    for (const etcd::KeyValue& kv : read->kvs) {
      v1::StepDecision decision;
      EXPECT_TRUE(decision.ParseFromString(kv.value)) << kv.key;
      if (decision.committed()) decisions[decision.step()] = decision;
    }
    return decisions;
  }
};

// Two groups: nodes 0-5 and 6-11.
class TwelveNodeClusterTest : public ClusterTest {
 protected:
  TwelveNodeClusterTest() : ClusterTest(2 * kGroupSize) {}
};

// Every node drains every second committed step into its own folder of one shared directory.
class DurableClusterTest : public ClusterTest {
 protected:
  DurableClusterTest() {
    char folder[] = "/tmp/moesnap-durable-cluster-XXXXXX";
    root_ = mkdtemp(folder);
    extra_config_ = absl::StrCat("[durable]\ndirectory = \"", root_, "\"\nevery_steps = 2\nkeep = 2\n");
  }
  void TearDown() override {
    daemons_.clear();
    std::filesystem::remove_all(root_);
  }

  v1::ListDurableResponse ListDurable(int node) {
    auto stub = v1::Admin::NewStub(grpc::CreateChannel("unix:" + daemons_[node]->admin_socket(),
                                                       grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    v1::ListDurableResponse response;
    const grpc::Status status = stub->ListDurable(&context, {}, &response);
    EXPECT_TRUE(status.ok()) << "node " << node << ": " << status.error_message();
    return response;
  }

  // Trains every node to `step` and waits until that step is durable on every node.
  void TrainAndDrain(int64_t step) {
    TrainAll(step);
    for (int attempt = 0; attempt < 600; ++attempt) {
      bool drained = true;
      for (int node = 0; node < nodes_ && drained; ++node) {
        const v1::DurableStatus status = ListDurable(node).status();
        drained = status.latest_step() >= step && !status.has_draining_step();
      }
      if (drained) return;
      std::this_thread::sleep_for(50ms);
    }
    FAIL() << "step " << step << " did not become durable on every node";
  }

  std::string root_;
};

TEST_F(DurableClusterTest, EveryDaemonAndPoolLostRestoresTheNewestStepDurableOnEveryNode) {
  // Each step is durable before the next is due (the first committed step always is).
  for (int64_t step : {1, 2, 4, 6}) ASSERT_NO_FATAL_FAILURE(TrainAndDrain(step));
  TrainAll(7);
  EXPECT_EQ(ListDurable(3).newest_everywhere(), 6);
  // A power loss: every daemon SIGKILLed, every pool gone.
  for (int node = 0; node < nodes_; ++node) Replace(node);
  for (int node = 0; node < nodes_; ++node) ASSERT_TRUE(daemons_[node]->Start());
  // Every node behind step 7, which no node holds: their rebuilds fail until the job goes back.
  ASSERT_NO_FATAL_FAILURE(WaitForLive(nodes_));
  for (int node = 0; node < nodes_; ++node) {
    std::string tier;
    EXPECT_EQ(VerifiedStep(node, &tier), 6) << "node " << node;
    EXPECT_EQ(tier, "durable") << "node " << node;
  }
  // Training goes on from there, committed in memory and encoded anew.
  TrainAll(9);
  for (int node = 0; node < nodes_; ++node) {
    std::string tier;
    EXPECT_EQ(VerifiedStep(node, &tier), 9) << "node " << node;
    EXPECT_EQ(tier, "memory") << "node " << node;
  }
}

// The records in etcd decide which step is durable on every node, not the disks: node 3's disk
// holds step 6, but its record lists only step 4, so after a power loss the job goes back to 4.
TEST_F(DurableClusterTest, AStepOnDiskThatANodesRecordInEtcdDoesNotListIsNotUsed) {
  for (int64_t step : {1, 2, 4, 6}) ASSERT_NO_FATAL_FAILURE(TrainAndDrain(step));
  TrainAll(7);
  ASSERT_EQ(ListDurable(3).newest_everywhere(), 6);
  absl::StatusOr<std::unique_ptr<etcd::Client>> client = etcd::Client::Create(etcd_->ClientOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  const std::string key = "/moesnap/cluster-test/durable/3";
  absl::StatusOr<std::optional<etcd::KeyValue>> stored = (*client)->Get(key);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_TRUE(stored->has_value()) << "node 3 recorded no durable steps in etcd";
  EXPECT_EQ((*stored)->lease, 0) << "the record must outlive every lease";
  v1::DurableRecord record;
  ASSERT_TRUE(record.ParseFromString((*stored)->value));
  ASSERT_EQ(std::vector<int64_t>(record.steps().begin(), record.steps().end()),
            std::vector<int64_t>({4, 6}));
  record.clear_steps();
  record.add_steps(4);
  ASSERT_TRUE((*client)->Put(key, record.SerializeAsString()).ok());
  ASSERT_TRUE(std::filesystem::exists(root_ + "/node-3/step-6"));
  EXPECT_EQ(ListDurable(0).newest_everywhere(), 4);
  for (int node = 0; node < nodes_; ++node) Replace(node);
  for (int node = 0; node < nodes_; ++node) ASSERT_TRUE(daemons_[node]->Start());
  ASSERT_NO_FATAL_FAILURE(WaitForLive(nodes_));
  for (int node = 0; node < nodes_; ++node) {
    std::string tier;
    EXPECT_EQ(VerifiedStep(node, &tier), 4) << "node " << node;
    EXPECT_EQ(tier, "durable") << "node " << node;
  }
  // The restore abandoned step 6: it is gone from every disk and every record.
  for (int node = 0; node < nodes_; ++node) {
    EXPECT_FALSE(std::filesystem::exists(absl::StrCat(root_, "/node-", node, "/step-6")));
    absl::StatusOr<std::optional<etcd::KeyValue>> now =
        (*client)->Get(absl::StrCat("/moesnap/cluster-test/durable/", node));
    ASSERT_TRUE(now.ok() && now->has_value()) << "node " << node;
    ASSERT_TRUE(record.ParseFromString((*now)->value));
    EXPECT_EQ(std::vector<int64_t>(record.steps().begin(), record.steps().end()),
              std::vector<int64_t>({4})) << "node " << node;
  }
}

// More than m nodes of the group lost with their memory: the replacements cannot rebuild, so the
// whole job, survivors included, goes back to the newest step durable on every node, and commits
// again from there.
TEST_F(DurableClusterTest, MoreThanMLossesTakeEveryNodeBackToTheNewestDurableStep) {
  for (int64_t step : {1, 2, 4, 6}) ASSERT_NO_FATAL_FAILURE(TrainAndDrain(step));
  TrainAll(7);  // committed in memory, not durable
  for (int node : {0, 2, 3}) Replace(node);
  for (int node : {0, 2, 3}) ASSERT_TRUE(daemons_[node]->Start());
  ASSERT_NO_FATAL_FAILURE(WaitForLive(nodes_));  // the replacements' rebuilds fail
  for (int node = 0; node < nodes_; ++node) {
    std::string tier;
    EXPECT_EQ(VerifiedStep(node, &tier), 6) << "node " << node;
    EXPECT_EQ(tier, "durable") << "node " << node;
  }
  TrainAll(9);
  for (int node = 0; node < nodes_; ++node) {
    std::string tier;
    EXPECT_EQ(VerifiedStep(node, &tier), 9) << "node " << node;
    EXPECT_EQ(tier, "memory") << "node " << node;
  }
}

// A node's journal holds its whole committed state, every group member's image in it. Steps of
// 600 tensors per node are more than 64 KiB journals hold: the nodes refuse them before they
// encode, each step aborts at once naming the setting to raise, every trainer's commit ends with
// that reason instead of waiting out its timeout, and the daemons serve on.
class SmallJournalClusterTest : public ClusterTest {
 protected:
  SmallJournalClusterTest() { journal_bytes_ = "64KiB"; }
};

TEST_F(SmallJournalClusterTest, AStepNoJournalCanHoldAbortsAtOnceNamingTheSetting) {
  std::vector<std::unique_ptr<ChildProcess>> trainers;
  for (int node = 0; node < nodes_; ++node) {
    trainers.push_back(std::make_unique<ChildProcess>(std::vector<std::string>{
        BinaryPath("moesnap-test-trainer"), "--socket", daemons_[node]->agent_socket(), "--rank",
        std::to_string(node), "--mode", "train", "--regions", "600", "--region-bytes", "1000",
        "--steps", "2"}));
  }
  for (int node = 0; node < nodes_; ++node) {
    std::string last, output;
    while (std::optional<std::string> line = trainers[node]->ReadLine(120s)) {
      last = *line;
      absl::StrAppend(&output, *line, "\n");
    }
    EXPECT_TRUE(absl::StartsWith(last, "error commit:")) << "trainer of node " << node << ":\n"
                                                          << output;
    EXPECT_TRUE(absl::StrContains(last, "cannot journal it")) << last;
    EXPECT_TRUE(absl::StrContains(last, "raise pool.journal_bytes to at least")) << last;
    EXPECT_EQ(trainers[node]->Wait(10s), 3) << "trainer of node " << node;
  }
  for (int node = 0; node < nodes_; ++node) {
    EXPECT_TRUE(daemons_[node]->running()) << "node " << node;
    const v1::ClusterStatusResponse status = Status(node);
    EXPECT_FALSE(status.has_latest_committed_step()) << "node " << node;
    EXPECT_TRUE(absl::StrContains(status.last_abort(), "pool.journal_bytes"))
        << "node " << node << ": " << status.last_abort();
  }
}

TEST_F(ClusterTest, EveryNodeAgreesOnTheCommittedStep) {
  TrainAll(6);
  for (int node = 0; node < nodes_; ++node) {
    const v1::ClusterStatusResponse status = Status(node);
    EXPECT_EQ(status.latest_committed_step(), 6) << "node " << node;
    // Each node holds its own data whole and parity for the group: m/n of the stripes.
    EXPECT_EQ(status.nodes(node).memory().data_bytes(), (4 + node) * 200000u) << "node " << node;
  }
  // Step 1 encodes whole; later steps keep the layout, so only changed units' deltas are sent (and
  // the restores below check that parity built from deltas decodes right). Steps the trainers
  // took while a commit ran are skipped, so not every step is encoded.
  for (int node = 0; node < nodes_; ++node) {
    const v1::ClusterStatusResponse status = Status(node);
    EXPECT_EQ(status.full_encodes(), 1u) << "node " << node;
    EXPECT_GE(status.delta_encodes(), 1u) << "node " << node;
    EXPECT_LE(status.delta_encodes(), 5u) << "node " << node;
  }
  uint64_t parity = 0;
  const v1::ClusterStatusResponse status = Status(0);
  for (const v1::ClusterNodeStatus& peer : status.nodes()) parity += peer.memory().parity_bytes();
  EXPECT_GT(parity, 0u);
  for (int node = 0; node < nodes_; ++node) EXPECT_EQ(VerifiedStep(node), 6);
}

// A node's journal is a file, so the images of the group record in it are checked as a peer's
// would be before the node builds on them: a record that fails is not used, with a warning naming
// the check, and the node rebuilds its committed step from its group. Nothing is lost.
TEST_F(ClusterTest, AJournalRecordThatFailsAPeersChecksIsNotUsedAndTheNodeRebuilds) {
  TrainAll(2);
  daemons_[1]->Kill(SIGKILL);
  {
    absl::StatusOr<std::unique_ptr<daemon::Journal>> journal =
        daemon::Journal::OpenOrCreate(daemons_[1]->pool_name(), daemon::Journal::kMinimumBytes);
    ASSERT_TRUE(journal.ok()) << journal.status();
    v1::JournalState state = (*journal)->recovered_state();
    ASSERT_EQ(state.cluster().group_images_size(), kGroupSize);
    // Node 2's image says a byte more than its regions hold; the journal's own CRC is intact.
    v1::NodeImage& image = *state.mutable_cluster()->mutable_group_images(2);
    image.set_bytes(image.bytes() + 1);
    const std::string bytes = state.SerializeAsString();
    ASSERT_TRUE((*journal)->Write({bytes}).ok());
  }
  {
    ChildProcess restarted({BinaryPath("moesnapd"), "--config", daemons_[1]->config_path()},
                           EnvironmentOf(1), ChildProcess::Stderr::kCapture);
    std::string output;
    std::optional<std::string> warning;
    while (!warning) {
      std::optional<std::string> line = restarted.ReadLine(60s);
      if (!line) break;
      absl::StrAppend(&output, *line, "\n");
      if (absl::StrContains(*line, "fails the checks a peer's must pass")) warning = line;
    }
    ASSERT_TRUE(warning.has_value()) << output;
    EXPECT_TRUE(absl::StrContains(*warning, "image of node 2: its regions add up to")) << *warning;
    restarted.Kill(SIGKILL);
  }
  ASSERT_TRUE(daemons_[1]->Start(EnvironmentOf(1)));
  ASSERT_NO_FATAL_FAILURE(WaitForCluster(nodes_));
  EXPECT_EQ(Status(1).latest_committed_step(), 2);
  for (int node = 0; node < nodes_; ++node) EXPECT_EQ(VerifiedStep(node), 2) << "node " << node;
  TrainAll(4);
  for (int node = 0; node < nodes_; ++node) EXPECT_EQ(VerifiedStep(node), 4) << "node " << node;
}

TEST_F(ClusterTest, TwoNodesLostAreRebuiltFromParityByteForByte) {
  TrainAll(6);
  Replace(1);
  Replace(4);
  ASSERT_TRUE(daemons_[1]->Start());
  ASSERT_TRUE(daemons_[4]->Start());
  ASSERT_NO_FATAL_FAILURE(WaitForCluster(nodes_));
  for (int node : {1, 4}) {
    EXPECT_EQ(Status(node).latest_committed_step(), 6) << "replacement node " << node;
  }
  for (int node = 0; node < nodes_; ++node) {
    EXPECT_EQ(VerifiedStep(node), 6) << "node " << node;
  }
  // The rebuilt cluster keeps committing, and a second loss is rebuilt from the new parity.
  TrainAll(9);
  Replace(0);
  ASSERT_TRUE(daemons_[0]->Start());
  ASSERT_NO_FATAL_FAILURE(WaitForCluster(nodes_));
  for (int node = 0; node < nodes_; ++node) {
    EXPECT_EQ(VerifiedStep(node), 9) << "node " << node;
  }
}

TEST_F(ClusterTest, MoreThanMLossesNameTheGroupAndTheLostStep) {
  TrainAll(5);
  for (int node : {0, 2, 3}) Replace(node);
  ASSERT_TRUE(daemons_[2]->Start());
  // The replacement cannot rebuild: Restore says which group, which nodes and which step.
  ChildProcess verify(TrainerArguments(*daemons_[2], 2, "verify", 0));
  std::string output;
  while (std::optional<std::string> line = verify.ReadLine(60s)) absl::StrAppend(&output, *line);
  EXPECT_EQ(verify.Wait(10s), 3) << output;
  EXPECT_TRUE(absl::StrContains(output, "group 0")) << output;
  EXPECT_TRUE(absl::StrContains(output, "step 5 of node 2 can no longer be recovered")) << output;
  // The survivors are not affected.
  for (int node : {1, 4, 5}) EXPECT_EQ(VerifiedStep(node), 5) << "node " << node;
}

TEST_F(ClusterTest, CoordinatorKilledWhileStepsCommitLosesNothing) {
  std::vector<std::unique_ptr<ChildProcess>> trainers;
  for (int node = 0; node < nodes_; ++node) {
    trainers.push_back(std::make_unique<ChildProcess>(
        TrainerArguments(*daemons_[node], node, "train", 1000000)));
  }
  // Let a few steps commit, then kill the coordinator in the middle of the next ones.
  for (int attempt = 0; Status(1).latest_committed_step() < 3; ++attempt) {
    ASSERT_LT(attempt, 600) << "no step committed";
    std::this_thread::sleep_for(50ms);
  }
  const int coordinator = Coordinator(1);
  ASSERT_GE(coordinator, 0);
  Replace(coordinator);
  // Steps go on being captured while the node is missing; none can commit without it, and another
  // node takes over coordinating once the lost one's lease ends.
  const int survivor = (coordinator + 1) % nodes_;
  for (int attempt = 0; Coordinator(survivor) == coordinator || Coordinator(survivor) < 0;
       ++attempt) {
    ASSERT_LT(attempt, 200) << "no node took over coordinating";
    std::this_thread::sleep_for(50ms);
  }
  for (auto& trainer : trainers) trainer->Kill(SIGKILL);
  trainers.clear();
  ASSERT_TRUE(daemons_[coordinator]->Start());
  ASSERT_NO_FATAL_FAILURE(WaitForCluster(nodes_));
  const int64_t step = AgreedCommittedStep();
  ASSERT_GE(step, 3);
  for (int node = 0; node < nodes_; ++node) {
    EXPECT_EQ(VerifiedStep(node), step) << "node " << node;
  }
}

// The coordinator (node 0) is SIGKILLed right after it writes the decision of step 3 (or of the
// first later step that commits) to etcd, before any node heard from it. Every other node still
// commits that step, from etcd alone, and the replacement of node 0 rebuilds it.
class CoordinatorCrashTest : public ClusterTest {
 protected:
  std::vector<std::string> EnvironmentOf(int node) override {
    if (node == 0) return {"MOESNAP_CRASH_IN_COMMIT=3"};
    return {};
  }
};

TEST_F(CoordinatorCrashTest, NodesCommitTheStepADeadCoordinatorDecided) {
  std::vector<std::unique_ptr<ChildProcess>> trainers;
  for (int node = 0; node < nodes_; ++node) {
    trainers.push_back(std::make_unique<ChildProcess>(
        TrainerArguments(*daemons_[node], node, "train", 1000000)));
  }
  if (!daemons_[0]->WaitExit(60s).has_value()) {
    // Stopped first: a trainer that goes on printing would never let its output end.
    for (auto& trainer : trainers) trainer->Kill(SIGKILL);
    for (int node = 0; node < nodes_; ++node) {
      std::string output;
      while (std::optional<std::string> line = trainers[node]->ReadLine(100ms)) output += *line + "\n";
      ADD_FAILURE() << "trainer of node " << node << ":\n" << output;
    }
    FAIL() << "node 0 did not crash in a commit";
  }
  // Every survivor commits the step the coordinator decided (3, or a later one if a slow start
  // aborted step 3); no step after it can commit without node 0.
  int64_t step = -1;
  for (int attempt = 0; attempt < 200; ++attempt) {
    step = Status(1).latest_committed_step();
    bool all = step >= 3;
    for (int node = 2; node < nodes_ && all; ++node) all = Status(node).latest_committed_step() == step;
    if (all) break;
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_GE(step, 3);
  for (auto& trainer : trainers) trainer->Kill(SIGKILL);
  trainers.clear();
  Replace(0);
  ASSERT_TRUE(daemons_[0]->Start());
  ASSERT_NO_FATAL_FAILURE(WaitForCluster(nodes_));
  for (int node = 0; node < nodes_; ++node) {
    EXPECT_EQ(Status(node).latest_committed_step(), step) << "node " << node;
    EXPECT_EQ(VerifiedStep(node), step) << "node " << node;
  }
}

// moesnapctl on a cluster: status of every node, a scrub that finds a flipped data byte and a flipped
// parity byte and repairs both from the group, and an operator-driven rebuild.
TEST_F(ClusterTest, CtlShowsTheClusterAndRepairsCorruptDataAndParityFromTheGroup) {
  TrainAll(1);
  CtlResult status = Ctl(*daemons_[2], {"cluster", "status"});
  EXPECT_EQ(status.exit_code, 0) << status.output;
  EXPECT_TRUE(absl::StrContains(status.output, "k=4 m=2, stripe unit 256.0 KiB, latest committed step 1"))
      << status.output;
  EXPECT_TRUE(absl::StrContains(status.output, "etcd 127.0.0.1:")) << status.output;
  EXPECT_TRUE(absl::StrContains(status.output, ": reachable")) << status.output;
  EXPECT_TRUE(absl::StrContains(status.output, "live, coordinator")) << status.output;
  CtlResult json = Ctl(*daemons_[2], {"--json", "cluster", "status"});
  EXPECT_EQ(json.exit_code, 0) << json.output;
  EXPECT_TRUE(absl::StrContains(json.output, "\"live\":true")) << json.output;

  // Node 2 holds 6 regions of 200,000 bytes (each in a 200,704-byte extent, from offset 0), then
  // its parity of stripe 1: one byte of region 0 and one byte of that parity unit are flipped.
  FlipPoolByte(*daemons_[2], 777);
  FlipPoolByte(*daemons_[2], 6 * 200704 + 100);
  CtlResult corrupt = Ctl(*daemons_[2], {"verify"});
  EXPECT_EQ(corrupt.exit_code, 1) << corrupt.output;
  EXPECT_TRUE(absl::StrContains(corrupt.output, "1 corrupt chunks")) << corrupt.output;
  EXPECT_TRUE(absl::StrContains(corrupt.output, "parity units held for the group: 1 corrupt"))
      << corrupt.output;
  CtlResult repaired = Ctl(*daemons_[2], {"verify", "--repair"});
  EXPECT_EQ(repaired.exit_code, 0) << repaired.output;
  EXPECT_TRUE(absl::StrContains(repaired.output, "repaired 1 chunks and 1 parity units"))
      << repaired.output;
  CtlResult clean = Ctl(*daemons_[2], {"verify"});
  EXPECT_EQ(clean.exit_code, 0) << clean.output;
  EXPECT_EQ(VerifiedStep(2), 1);

  CtlResult rebuilt = Ctl(*daemons_[2], {"rebuild", "3"});
  EXPECT_EQ(rebuilt.exit_code, 0) << rebuilt.output;
  EXPECT_TRUE(absl::StrContains(rebuilt.output, "node 3 rebuilt step 1")) << rebuilt.output;
  EXPECT_EQ(VerifiedStep(3), 1);
  CtlResult single = Ctl(*daemons_[2], {"rebuild", "9"});
  EXPECT_EQ(single.exit_code, 4) << single.output;
  EXPECT_TRUE(absl::StrContains(single.output, "node 9 is not in the cluster")) << single.output;
}

// Elastic restore after losing two nodes: the planner moves the lost nodes' experts (every region a
// rank snapshotted is an expert held once, on its rank's node) onto the survivors; each moved expert
// is restored into a new rank on its new node, decoded from the group's parity since its holder is
// gone, and a region of a live rank is fetched from its holder; each answer says which. Every byte
// is compared.
TEST_F(ClusterTest, ElasticRestoreMovesLostExpertsOntoSurvivorsByteForByte) {
  TrainAll(5);  // step 5 captures every region, so each holds the bytes of (rank, region, 5)
  struct Expert {
    uint32_t rank;
    int region;
  };
  std::vector<Expert> experts;
  Placement current(nodes_);
  for (int node = 0; node < nodes_; ++node) {
    for (int region = 0; region < 4 + node; ++region) {
      current[node].push_back(static_cast<int>(experts.size()));
      experts.push_back({static_cast<uint32_t>(node), region});
    }
  }
  for (int node : {1, 4}) Replace(node);  // lost for good: no replacement is started
  const PlanOptions options{nodes_, 10, 1};
  absl::StatusOr<Reconfiguration> plan = Reconfigure(
      std::vector<double>(experts.size(), 1.0), options, current, {1, 4});
  ASSERT_TRUE(plan.ok()) << plan.status();
  int moved = 0;
  for (const Transfer& transfer : plan->transfers) {
    const Expert& expert = experts[transfer.expert];
    if (transfer.from) continue;  // a surviving replica: nothing to restore from snapshots
    EXPECT_TRUE(expert.rank == 1 || expert.rank == 4) << "only lost experts come from snapshots";
    RestoreOnto(transfer.to, expert.rank, {expert.region}, 100 + moved, /*decoded=*/true);
    ++moved;
  }
  EXPECT_EQ(moved, 5 + 8);  // every expert of nodes 1 and 4
  RestoreOnto(0, 2, {3}, 200, /*decoded=*/false);  // node 2 is live: fetched from it
  // Every region of a live rank at once, onto a node that located it before and one that did not.
  RestoreOnto(0, 2, {0, 1, 2, 3, 4, 5}, 201, /*decoded=*/false);
  RestoreOnto(3, 2, {0, 1, 2, 3, 4, 5}, 202, /*decoded=*/false);
  // Node 0's restores, one after another in batches of at most 1 MiB, left one 1 MiB buffer kept.
  absl::StatusOr<testing::HttpReply> metrics =
      testing::HttpGet(daemons_[0]->http_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_TRUE(absl::StrContains(metrics->body, "\nmoesnap_restore_buffer_bytes 1048576\n"))
      << metrics->body;

}

// A byte of node 2's committed region 0 flipped in its pool: node 2 sends each chunk with its stored
// CRC-32C, and the restoring node, checking the bytes against the stored CRCs as it writes them
// into the rank, finds the damage and decodes the regions from the group instead.
TEST_F(ClusterTest, ARegionDamagedInItsHoldersMemoryIsDecodedFromTheGroupInstead) {
  TrainAll(5);
  {  // The region's bytes are found in node 2's pool by their content.
    std::ifstream pool("/dev/shm/" + daemons_[2]->pool_name() + ".data", std::ios::binary);
    const std::string held((std::istreambuf_iterator<char>(pool)), std::istreambuf_iterator<char>());
    std::string region(200000, '\0');
    testing::DeterministicBytes(uint64_t{2} << 48 ^ uint64_t{0} << 32 ^ 5)
        .Fill(reinterpret_cast<uint8_t*>(region.data()), region.size());
    const size_t at = held.find(region);
    ASSERT_NE(at, std::string::npos) << "rank 2's region 0 of step 5 is not in node 2's pool";
    FlipPoolByte(*daemons_[2], at + 777);
  }
  const CtlResult corrupt = Ctl(*daemons_[2], {"verify"});
  ASSERT_TRUE(absl::StrContains(corrupt.output, "1 corrupt chunks")) << corrupt.output;
  RestoreOnto(0, 2, {0, 1}, 200, /*decoded=*/true);
  RestoreOnto(3, 2, {1, 2}, 201, /*decoded=*/false);  // undamaged regions are fetched
}

// Node 2 paused (SIGSTOP) while it holds the committed step: its rank's regions restored onto node 0
// are asked of node 2, which never answers; once node 2's lease ends the fetch gives up and the
// regions are decoded from the group, byte for byte, well before any fetch timeout. They go in two
// batches (restore_buffer_bytes): the second is decoded without asking node 2 again.
TEST_F(ClusterTest, AnElasticRestoreFromAHolderPausedPastItsLeaseIsDecodedFromTheGroup) {
  TrainAll(5);
  ASSERT_TRUE(daemons_[2]->Pause());
  const auto start = std::chrono::steady_clock::now();
  RestoreOnto(0, 2, {0, 1, 2, 3, 4, 5}, 300, /*decoded=*/true);
  // A lease (2 s here) and a decode, not the fetch timeout (Transfer::kFetchWait, 30 s).
  EXPECT_LT(std::chrono::steady_clock::now() - start, 25s);
  daemons_[2]->Kill(SIGKILL);  // its lease ended: the job has lost it
}

// A daemon whose cluster config differs from its peers' does not join, and says what differs.
TEST_F(ClusterTest, ADaemonWithAnotherClusterConfigIsRefusedNamingTheDifference) {
  daemons_[5]->Kill(SIGKILL);
  daemons_[5]->WaitExit(10s);
  std::stringstream text;
  text << std::ifstream(daemons_[5]->config_path()).rdbuf();
  std::string config = text.str();
  const size_t at = config.find("256KiB");
  ASSERT_NE(at, std::string::npos);
  config.replace(at, 6, "512KiB");
  std::ofstream(daemons_[5]->config_path()) << config;
  ChildProcess daemon({BinaryPath("moesnapd"), "--config", daemons_[5]->config_path()}, {},
                      ChildProcess::Stderr::kCapture);
  std::string output;
  while (std::optional<std::string> line = daemon.ReadLine(30s)) output += *line + "\n";
  EXPECT_NE(daemon.Wait(10s).value_or(0), 0) << output;
  EXPECT_TRUE(absl::StrContains(output, "node 5 cannot join job 'cluster-test'")) << output;
  EXPECT_TRUE(absl::StrContains(output, "stripe_unit_bytes: 524288 here, 262144 there")) << output;
}

// The scenario: node 5 is lost with its memory after step 2; nodes 0-4 train on and their
// steps commit without it; node 4 is lost too in the middle of them, and nodes 0-3 go on committing
// without both, 20 degraded commits in all. Each decision names the absent nodes, status and metrics
// say the cluster is degraded. Node 5's replacement starts while nodes 0-3 still train, its
// rebuild slow (it installs what it decoded only once 3 more steps committed,
// MOESNAP_REBUILD_HOLD_STEPS): steps go on committing during the rebuild with it absent, receiving
// their parity, and it catches up from that. Node 4's replacement follows. Every rank restores its
// latest committed step byte for byte (node 5's rank step 2, node 4's the last step it took part
// in, the others the latest step, committed while node 5 rebuilt).
TEST_F(DegradedClusterTest, StepsCommitWhileNodesAreLostAndEveryRankRestoresItsLatestStep) {
  TrainAll(2);
  Replace(5);  // lost, no replacement yet
  ASSERT_NO_FATAL_FAILURE(WaitForLost(5));
  // Paced (a step of compute each), so that node 4 is lost while steps go on.
  std::vector<std::unique_ptr<ChildProcess>> trainers;
  for (int node = 0; node < 5; ++node) {
    std::vector<std::string> arguments = TrainerArguments(*daemons_[node], node, "train", 1000000);
    arguments.insert(arguments.end(), {"--step-ms", "100"});
    trainers.push_back(std::make_unique<ChildProcess>(arguments));
  }
  for (int attempt = 0; Status(0).latest_committed_step() < 8; ++attempt) {
    ASSERT_LT(attempt, 1200) << "no step committed without node 5: " << Status(0).last_abort();
    std::this_thread::sleep_for(50ms);
  }
  trainers[4]->Kill(SIGKILL);
  Replace(4);
  // Steps abort until node 4's lease ends, then commit without nodes 4 and 5: 20 steps committed
  // degraded in all.
  for (int attempt = 0;; ++attempt) {
    const v1::ClusterStatusResponse status = Status(0);
    if (status.degraded_commits() >= 20 && status.absent_nodes_size() == 2) break;
    ASSERT_LT(attempt, 1200) << "no step committed without nodes 4 and 5: " << status.last_abort();
    std::this_thread::sleep_for(50ms);
  }
  const v1::ClusterStatusResponse status = Status(1);
  EXPECT_GE(status.latest_committed_step(), 22);
  EXPECT_GE(status.degraded_commits(), 20u);
  EXPECT_EQ(std::vector<uint32_t>(status.absent_nodes().begin(), status.absent_nodes().end()),
            (std::vector<uint32_t>{4, 5}));
  CtlResult ctl = Ctl(*daemons_[1], {"cluster", "status"});
  EXPECT_TRUE(absl::StrContains(ctl.output, "degraded: nodes [4, 5] absent")) << ctl.output;
  absl::StatusOr<testing::HttpReply> metrics = testing::HttpGet(daemons_[1]->http_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_TRUE(absl::StrContains(metrics->body, "\nmoesnap_cluster_absent_nodes 2\n")) << metrics->body;
  EXPECT_TRUE(absl::StrContains(metrics->body, "\nmoesnap_cluster_degraded_commits_total "))
      << metrics->body;

  // Node 5's replacement starts while nodes 0-3 train on, its rebuild slow: steps commit without
  // it meanwhile, and it catches up from the parity it receives. Once it takes part, steps abort
  // (no trainer captures its rank's steps), so node 4's replacement starts after it, the trainers
  // still running, and rebuilds the latest step.
  const int64_t before_replacements = CommittedDecisions().rbegin()->first;
  ASSERT_TRUE(daemons_[5]->Start({"MOESNAP_REBUILD_HOLD_STEPS=3"}));
  for (int attempt = 0;; ++attempt) {
    const v1::ClusterStatusResponse seen = Status(0);
    if (seen.nodes(5).live() && seen.nodes(5).answered() && !seen.nodes(5).rebuilding()) break;
    ASSERT_LT(attempt, 1200) << "node 5 did not rebuild while the others trained: "
                             << Status(5).rebuild_error() << "; last abort: " << seen.last_abort();
    std::this_thread::sleep_for(50ms);
  }
  absl::StatusOr<testing::HttpReply> rejoined = testing::HttpGet(daemons_[5]->http_port(), "/metrics");
  ASSERT_TRUE(rejoined.ok()) << rejoined.status();
  const std::string counter = "\nmoesnap_rebuild_caught_up_steps_total ";
  const size_t at = rejoined->body.find(counter);
  ASSERT_NE(at, std::string::npos) << rejoined->body;
  const size_t begin = at + counter.size();
  int64_t caught_up = 0;
  ASSERT_TRUE(absl::SimpleAtoi(
      rejoined->body.substr(begin, rejoined->body.find('\n', begin) - begin), &caught_up))
      << rejoined->body;
  EXPECT_GE(caught_up, 1) << "node 5 caught up with no step from the parity it received";
  ASSERT_TRUE(daemons_[4]->Start());
  ASSERT_NO_FATAL_FAILURE(WaitForCluster(nodes_));
  for (auto& trainer : trainers) trainer->Kill(SIGKILL);
  trainers.clear();

  // Node 5 is absent from every step after 2; node 4 took part up to a step, and is absent after,
  // the steps committed during node 5's rebuild included.
  int64_t last_of_node_4 = -1;
  bool both_absent = false;
  int committed_during_rebuilds = 0;
  for (const auto& [step, decision] : CommittedDecisions()) {
    const std::set<uint32_t> absent(decision.absent().begin(), decision.absent().end());
    if (step <= 2) {
      EXPECT_TRUE(absent.empty()) << "step " << step;
    } else if (absent == std::set<uint32_t>{5}) {
      EXPECT_FALSE(both_absent) << "step " << step << " has node 4 back";
      last_of_node_4 = step;
    } else {
      EXPECT_EQ(absent, (std::set<uint32_t>{4, 5})) << "step " << step;
      both_absent = true;
      if (step > before_replacements) ++committed_during_rebuilds;
    }
  }
  ASSERT_GE(last_of_node_4, 8);
  ASSERT_TRUE(both_absent) << "no step committed without nodes 4 and 5";
  EXPECT_GE(committed_during_rebuilds, 1) << "no step committed while node 5 rebuilt";

  const int64_t latest = AgreedCommittedStep();
  ASSERT_GT(latest, before_replacements);
  EXPECT_EQ(CommittedDecisions().rbegin()->first, latest);
  for (int node = 0; node < 4; ++node) EXPECT_EQ(VerifiedStep(node), latest) << "node " << node;
  EXPECT_EQ(VerifiedStep(4), last_of_node_4);
  EXPECT_EQ(VerifiedStep(5), 2);
}

// Each group codes only its own nodes: losing m nodes in each group at once (4 of 12) is survived,
// every node rebuilt or kept byte for byte.
TEST_F(TwelveNodeClusterTest, MNodesLostInEveryGroupAreRebuilt) {
  TrainAll(5);
  for (int node : {1, 4, 6, 11}) Replace(node);
  for (int node : {1, 4, 6, 11}) ASSERT_TRUE(daemons_[node]->Start());
  ASSERT_NO_FATAL_FAILURE(WaitForCluster(nodes_));
  for (int node = 0; node < nodes_; ++node) {
    EXPECT_EQ(Status(node).latest_committed_step(), 5) << "node " << node;
    EXPECT_EQ(VerifiedStep(node), 5) << "node " << node;
  }
}

}  // namespace
}  // namespace moesnap
