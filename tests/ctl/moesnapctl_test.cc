// moesnapctl against a real daemon: tables, JSON, and the exit codes scripts rely on, including a
// corrupt chunk found by verify (and refused by restore) after a byte of the pool is flipped.
#include <gtest/gtest.h>

#include <fstream>

#include "absl/strings/match.h"
#include "client/ctl/format.h"
#include "common/version.h"
#include "moesnap/client.h"
#include "tests/testing/child_process.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::TestDaemon;
using namespace std::chrono_literals;

struct Result {
  int exit_code;
  std::string output;  // stdout and stderr
};

Result Ctl(const std::string& socket, std::vector<std::string> arguments) {
  arguments.insert(arguments.begin(), {BinaryPath("moesnapctl"), "--socket", socket});
  ChildProcess ctl(arguments, {}, ChildProcess::Stderr::kCapture);
  Result result{-1, ""};
  while (std::optional<std::string> line = ctl.ReadLine(30s)) result.output += *line + "\n";
  result.exit_code = ctl.Wait(30s).value_or(-1);
  return result;
}

TEST(MoesnapctlTest, DropRankLeavesARegisteredRankOutAndStatusSaysSo) {
  TestDaemon daemon({.pool_bytes = "16MiB"});
  ASSERT_TRUE(daemon.Start());
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.socket_path = daemon.agent_socket(), .rank = 3});
  ASSERT_OK(client);
  absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = (*client)->AllocateHost(4096);
  ASSERT_OK(buffer);
  ASSERT_OK((*client)->RegisterHostRegion({"weights", "uint8", {4096}}, *buffer, 0, 4096));

  Result unknown = Ctl(daemon.admin_socket(), {"drop-rank", "9"});
  EXPECT_EQ(unknown.exit_code, 4) << unknown.output;
  EXPECT_TRUE(absl::StrContains(unknown.output, "rank 9 has no trainer registered"))
      << unknown.output;
  Result dropped = Ctl(daemon.admin_socket(), {"drop-rank", "3"});
  EXPECT_EQ(dropped.exit_code, 0) << dropped.output;
  Result status = Ctl(daemon.admin_socket(), {"status"});
  EXPECT_TRUE(absl::StrContains(status.output, "rank 3: dropped by an operator")) << status.output;
  Result json = Ctl(daemon.admin_socket(), {"status", "--json"});
  EXPECT_TRUE(absl::StrContains(json.output, "\"dropped_ranks\":[{\"rank\":3,")) << json.output;

  ASSERT_OK((*client)->Snapshot(1));  // its next snapshot brings it back
  status = Ctl(daemon.admin_socket(), {"status"});
  EXPECT_FALSE(absl::StrContains(status.output, "dropped by an operator")) << status.output;
}

TEST(MoesnapctlTest, ReportsStepsVerifiesDropsAndFindsACorruptChunk) {
  TestDaemon daemon({.pool_bytes = "64MiB"});
  ASSERT_TRUE(daemon.Start());
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.socket_path = daemon.agent_socket(), .rank = 3});
  ASSERT_OK(client);
  absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = (*client)->AllocateHost(1 << 20);
  ASSERT_OK(buffer);
  std::memset((*buffer)->data(), 0x11, 1 << 20);
  ASSERT_OK((*client)->RegisterHostRegion({"layer0.gate", "float32", {512, 512}}, *buffer, 0, 1 << 20));
  ASSERT_OK((*client)->Snapshot(40));
  ASSERT_OK((*client)->WaitCommitted(40));

  Result status = Ctl(daemon.admin_socket(), {"status"});
  EXPECT_EQ(status.exit_code, 0) << status.output;
  EXPECT_TRUE(absl::StrContains(status.output, "1.0 MiB")) << status.output;

  Result ls = Ctl(daemon.admin_socket(), {"ls"});
  EXPECT_EQ(ls.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(ls.output, "3     40    committed  1        1.0 MiB")) << ls.output;

  Result inspect = Ctl(daemon.admin_socket(), {"--json", "inspect", "40"});
  EXPECT_EQ(inspect.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(inspect.output, "\"region\":\"layer0.gate\"")) << inspect.output;
  EXPECT_TRUE(absl::StrContains(inspect.output, "\"shape\":[512,512]")) << inspect.output;
  EXPECT_TRUE(absl::StrContains(inspect.output, "\"state\":\"committed\"")) << inspect.output;
  EXPECT_TRUE(absl::StrContains(inspect.output, "\"bytes\":1048576,")) << inspect.output;

  // Global flags after the subcommand, numbers as numbers.
  Result json_status = Ctl(daemon.admin_socket(), {"status", "--json"});
  EXPECT_EQ(json_status.exit_code, 0) << json_status.output;
  EXPECT_TRUE(absl::StrContains(json_status.output, "\"pool_used_bytes\":1048576,"))
      << json_status.output;
  ChildProcess socket_last({BinaryPath("moesnapctl"), "ls", "--json", "--socket", daemon.admin_socket()});
  const std::optional<std::string> listed = socket_last.ReadLine(30s);
  ASSERT_TRUE(listed.has_value());
  EXPECT_TRUE(absl::StrContains(*listed, "\"step\":40,\"state\":\"committed\"")) << *listed;
  EXPECT_EQ(socket_last.Wait(30s), 0);

  Result clean = Ctl(daemon.admin_socket(), {"verify"});
  EXPECT_EQ(clean.exit_code, 0) << clean.output;
  EXPECT_TRUE(absl::StrContains(clean.output, "every CRC-32C matches")) << clean.output;

  // The only version sits at the start of the pool: flip one byte of it behind the daemon's back.
  {
    std::fstream pool("/dev/shm/" + daemon.pool_name() + ".data",
                      std::ios::in | std::ios::out | std::ios::binary);
    pool.seekp(777);
    pool.put(0x12);
  }
  Result corrupt = Ctl(daemon.admin_socket(), {"verify", "40"});
  EXPECT_EQ(corrupt.exit_code, ctl::kProblemFound) << corrupt.output;
  EXPECT_TRUE(absl::StrContains(corrupt.output, "1 corrupt chunks")) << corrupt.output;
  EXPECT_TRUE(absl::StrContains(corrupt.output, "layer0.gate")) << corrupt.output;
  absl::StatusOr<RestoreResult> restored = (*client)->Restore();
  ASSERT_STATUS(restored, absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(restored.status().message(), "layer0.gate")) << restored.status();

  Result missing = Ctl(daemon.admin_socket(), {"drop", "41"});
  EXPECT_EQ(missing.exit_code, ctl::kDaemonRefused);
  EXPECT_TRUE(absl::StrContains(missing.output, "NOT_FOUND: no committed version of step 41"))
      << missing.output;
  Result missing_json = Ctl(daemon.admin_socket(), {"drop", "41", "--json"});
  EXPECT_EQ(missing_json.exit_code, ctl::kDaemonRefused);
  EXPECT_TRUE(absl::StartsWith(
      missing_json.output,
      "{\"error\":{\"code\":\"not_found\",\"message\":\"no committed version of step 41"))
      << missing_json.output;
  EXPECT_TRUE(absl::StrContains(missing_json.output, "\"exit_code\":4}}")) << missing_json.output;
  Result dropped = Ctl(daemon.admin_socket(), {"drop", "40", "--rank", "3"});
  EXPECT_EQ(dropped.exit_code, 0) << dropped.output;
  EXPECT_TRUE(absl::StrContains(dropped.output, "dropped 1 versions of step 40")) << dropped.output;
  EXPECT_TRUE(absl::StrContains(Ctl(daemon.admin_socket(), {"ls"}).output, "no steps stored"));
}

TEST(MoesnapctlTest, UsageAndUnreachableDaemonHaveTheirOwnExitCodes) {
  EXPECT_EQ(Ctl("/nonexistent/admin.sock", {"drop"}).exit_code, ctl::kUsage);
  EXPECT_EQ(Ctl("/nonexistent/admin.sock", {"frobnicate"}).exit_code, ctl::kUsage);
  EXPECT_EQ(Ctl("/nonexistent/admin.sock", {"status", "--help"}).exit_code, ctl::kSuccess);
  Result unreachable = Ctl("/nonexistent/admin.sock", {"--timeout", "2", "status"});
  EXPECT_EQ(unreachable.exit_code, ctl::kDaemonUnreachable);
  EXPECT_TRUE(absl::StrContains(unreachable.output, "/nonexistent/admin.sock")) << unreachable.output;
  Result unreachable_json = Ctl("/nonexistent/admin.sock", {"status", "--timeout", "2", "--json"});
  EXPECT_EQ(unreachable_json.exit_code, ctl::kDaemonUnreachable);
  EXPECT_TRUE(absl::StartsWith(unreachable_json.output, "{\"error\":{\"code\":\"unavailable\""))
      << unreachable_json.output;
  EXPECT_TRUE(absl::StrContains(unreachable_json.output, "\"exit_code\":3}}"))
      << unreachable_json.output;
  Result usage_json = Ctl("/nonexistent/admin.sock", {"drop", "--json"});
  EXPECT_EQ(usage_json.exit_code, ctl::kUsage);
  EXPECT_TRUE(absl::StartsWith(usage_json.output, "{\"error\":{\"code\":\"usage\""))
      << usage_json.output;
}

// Every program answers --version with its name and the release, and exits 0.
TEST(MoesnapctlTest, EveryProgramPrintsItsVersion) {
  for (const std::string program : {"moesnapd", "moesnapctl", "moesnap-bench"}) {
    ChildProcess process({BinaryPath(program), "--version"});
    const std::optional<std::string> line = process.ReadLine(30s);
    ASSERT_TRUE(line.has_value()) << program;
    EXPECT_EQ(*line, program + " " + kVersion);
    EXPECT_EQ(process.Wait(30s), 0) << program;
  }
}

TEST(MoesnapctlTest, PlanPrintsPlacementRecoveryAndTransfersWithoutADaemon) {
  const std::string loads = ::testing::TempDir() + "/loads.txt";
  std::ofstream(loads) << "120\n40  # a quiet expert\n300 75\n10\n220\n90\n15\n";
  Result plan = Ctl("/nonexistent/admin.sock", {"plan", "--loads", loads, "--nodes", "6", "--slots",
                                                "2", "--failed", "1,4"});
  EXPECT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_TRUE(absl::StrContains(plan.output, "EXPERTS (maximum rank overlap)")) << plan.output;
  EXPECT_TRUE(absl::StrContains(plan.output, "after losing nodes 1, 4: 2 transfers")) << plan.output;
  EXPECT_TRUE(absl::StrContains(plan.output, "snapshot cluster")) << plan.output;
  Result json = Ctl("/nonexistent/admin.sock", {"--json", "plan", "--loads", loads, "--nodes", "6",
                                                "--slots", "2"});
  EXPECT_EQ(json.exit_code, 0) << json.output;
  EXPECT_TRUE(absl::StrContains(json.output, "\"replicas\":[1,1,4,1,1,2,1,1]")) << json.output;
  Result too_many = Ctl("/nonexistent/admin.sock", {"plan", "--loads", loads, "--nodes", "2",
                                                    "--slots", "2", "--min-replicas", "3"});
  EXPECT_EQ(too_many.exit_code, ctl::kUsage) << too_many.output;
  EXPECT_TRUE(absl::StrContains(too_many.output, "min_replicas 3 exceeds the 2 nodes"))
      << too_many.output;
  std::ofstream(loads) << "12 x7\n";
  Result malformed = Ctl("/nonexistent/admin.sock", {"plan", "--loads", loads, "--nodes", "2",
                                                     "--slots", "1"});
  EXPECT_EQ(malformed.exit_code, ctl::kUsage) << malformed.output;
  EXPECT_TRUE(absl::StrContains(malformed.output, "line 1: 'x7' is not a number")) << malformed.output;
}

TEST(FormatTest, TablesAlignAndBytesReadAsPeopleWrite) {
  EXPECT_EQ(ctl::Table({{"A", "BB"}, {"ccc", "d"}}), "A    BB\nccc  d\n");
  v1::VerifyResponse verify;
  verify.set_versions_checked(2);
  verify.set_chunks_checked(3);
  verify.set_bytes_checked(3 << 20);
  EXPECT_EQ(ctl::FormatVerify(verify),
            "checked 2 versions, 3 chunks, 3.0 MiB: every CRC-32C matches\n");
  EXPECT_EQ(ctl::ExitCodeFor(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "")),
            ctl::kDaemonUnreachable);
  EXPECT_EQ(ctl::ExitCodeFor(grpc::Status(grpc::StatusCode::DATA_LOSS, "")), ctl::kDaemonRefused);
}

// A node that rebuilds while steps commit without it says how many received steps it will catch
// up through; one that received none yet is only "rebuilding".
TEST(FormatTest, ClusterStatusSaysARebuildingNodeReceivesParity) {
  v1::ClusterStatusResponse cluster;
  cluster.add_absent_nodes(4);
  cluster.add_absent_nodes(5);
  cluster.set_degraded_commits(7);
  for (uint32_t id : {3u, 4u, 5u}) {
    v1::ClusterNodeStatus* node = cluster.add_nodes();
    node->set_node_id(id);
    node->set_live(true);
    node->set_answered(true);
    node->set_rebuilding(id != 3);
    if (id == 5) node->set_received_steps(3);
  }
  const std::string text = ctl::FormatClusterStatus(cluster);
  EXPECT_TRUE(absl::StrContains(text, "degraded: nodes [4, 5] absent")) << text;
  EXPECT_TRUE(absl::StrContains(text, "rebuilding, receiving parity (3 committed steps to catch up)"))
      << text;
  EXPECT_EQ(text.find("receiving parity"), text.rfind("receiving parity")) << text;
  EXPECT_TRUE(absl::StrContains(text, "rebuilding ")) << text;
}

}  // namespace
}  // namespace moesnap
