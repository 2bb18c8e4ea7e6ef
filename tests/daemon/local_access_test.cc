// Who may do what on one node, against a real moesnapd: a trainer acts only for the rank its
// session was bound to at Hello, another user cannot take a live rank, admin calls are served on
// the admin socket only, and uids listed in access.allowed_uids get in.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/memory_handoff_wire.h"
#include "moesnap/client.h"
#include "proto/moesnap.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::TestDaemon;
using namespace std::chrono_literals;

constexpr size_t kBytes = 1 << 16;
constexpr uid_t kNobody = 65534;

class LocalAccessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(daemon_.Start());
    agent_ = v1::Agent::NewStub(
        grpc::CreateChannel("unix:" + daemon_.agent_socket(), grpc::InsecureChannelCredentials()));
    // Rank 0: a real trainer with step 1 committed.
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.socket_path = daemon_.agent_socket(), .rank = 0});
    ASSERT_OK(client);
    victim_ = *std::move(client);
    absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = victim_->AllocateHost(kBytes);
    ASSERT_OK(buffer);
    buffer_ = *buffer;
    std::memset(buffer_->data(), 0x11, kBytes);
    ASSERT_OK(victim_->RegisterHostRegion({"weights", "uint8", {kBytes}}, buffer_, 0, kBytes));
    ASSERT_OK(victim_->Snapshot(1));
    ASSERT_OK(victim_->WaitCommitted(1));
  }

  // Hello as rank `rank` from this process; the session it returned.
  std::string Hello(uint32_t rank) {
    grpc::ClientContext context;
    v1::HelloRequest request;
    request.set_rank(rank);
    v1::HelloResponse response;
    const grpc::Status status = agent_->Hello(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.session();
  }

  grpc::Status RestoreOf(uint32_t rank, const std::string& session) {
    grpc::ClientContext context;
    if (!session.empty()) context.AddMetadata(memory_handoff::kSessionMetadataKey, session);
    v1::RestoreRequest request;
    request.set_rank(rank);
    v1::RestoreResponse response;
    return agent_->Restore(&context, request, &response);
  }

  // Rank 0 still holds its registration and its committed bytes.
  void ExpectVictimIntact() {
    std::memset(buffer_->data(), 0, kBytes);
    ASSERT_OK(victim_->Snapshot(2));
    ASSERT_OK(victim_->WaitCommitted(2));
    absl::StatusOr<RestoreResult> restored = victim_->Restore();
    ASSERT_OK(restored);
    EXPECT_EQ(restored->step, 2);
  }

  static void ExpectDenied(const grpc::Status& status, const std::vector<std::string>& mentions) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
    for (const std::string& text : mentions) {
      EXPECT_TRUE(absl::StrContains(status.error_message(), text))
          << "'" << status.error_message() << "' does not mention '" << text << "'";
    }
  }

  TestDaemon daemon_{{.pool_bytes = "16MiB",
                      .extra_config = absl::StrCat("[access]\nallowed_uids = [", kNobody, "]\n")}};
  std::unique_ptr<v1::Agent::Stub> agent_;
  std::unique_ptr<Client> victim_;
  std::shared_ptr<SharedBuffer> buffer_;
};

TEST_F(LocalAccessTest, ACallForAnotherRankIsRefusedNamingBothRanks) {
  const std::string session = Hello(1);
  ExpectDenied(RestoreOf(0, session), {"rank 0", "rank 1"});
  {
    grpc::ClientContext context;
    context.AddMetadata(memory_handoff::kSessionMetadataKey, session);
    v1::SnapshotRequest request;
    request.set_rank(0);
    request.set_step(5);
    v1::SnapshotResponse response;
    ExpectDenied(agent_->Snapshot(&context, request, &response), {"rank 0", "rank 1"});
  }
  {
    grpc::ClientContext context;
    context.AddMetadata(memory_handoff::kSessionMetadataKey, session);
    v1::RegisterRegionsRequest request;
    request.set_rank(0);
    v1::RegisterRegionsResponse response;
    ExpectDenied(agent_->RegisterRegions(&context, request, &response), {"rank 0", "rank 1"});
  }
  ExpectDenied(RestoreOf(0, ""), {"without a session"});
  ExpectDenied(RestoreOf(0, std::string(memory_handoff::kSessionBytes, 'x')), {"not current"});
  ASSERT_NO_FATAL_FAILURE(ExpectVictimIntact());
}

TEST_F(LocalAccessTest, AnotherUserCannotTakeALiveRankButMayUseAFreeOne) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a trainer as another user";
  ASSERT_EQ(chmod(daemon_.directory().c_str(), 0755), 0);
  auto as_nobody = [this](uint32_t rank) {
    ChildProcess trainer({"/usr/bin/setpriv", absl::StrCat("--reuid=", kNobody),
                          absl::StrCat("--regid=", kNobody), "--clear-groups",
                          BinaryPath("moesnap-test-trainer"), "--socket", daemon_.agent_socket(),
                          "--rank", std::to_string(rank), "--regions", "1", "--region-bytes",
                          "4096", "--steps", "1"});
    std::string output;
    while (std::optional<std::string> line = trainer.ReadLine(30s)) output += *line + "\n";
    return std::make_pair(trainer.Wait(10s), output);
  };
  const auto [taken, refusal] = as_nobody(0);
  EXPECT_NE(taken, 0) << refusal;
  EXPECT_TRUE(absl::StrContains(refusal, "PERMISSION_DENIED")) << refusal;
  EXPECT_TRUE(absl::StrContains(refusal, "rank 0 is held by a live trainer of uid 0")) << refusal;
  ASSERT_NO_FATAL_FAILURE(ExpectVictimIntact());
  // A listed uid gets in (the socket's mode does not refuse it first) and trains a rank of its own.
  const auto [trained, output] = as_nobody(7);
  EXPECT_EQ(trained, 0) << output;
}

TEST_F(LocalAccessTest, AUserLetInAsATrainerIsNoOperator) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another user";
  ASSERT_EQ(chmod(daemon_.directory().c_str(), 0755), 0);
  // Listed in access.allowed_uids, so a trainer; [admin] group is not set, so no operator.
  ChildProcess ctl({"/usr/bin/setpriv", absl::StrCat("--reuid=", kNobody),
                    absl::StrCat("--regid=", kNobody), "--clear-groups", BinaryPath("moesnapctl"),
                    "--socket", daemon_.admin_socket(), "drop", "1"},
                   {}, ChildProcess::Stderr::kCapture);
  std::string output;
  while (std::optional<std::string> line = ctl.ReadLine(30s)) output += *line + "\n";
  EXPECT_NE(ctl.Wait(10s), 0) << output;
  EXPECT_TRUE(absl::StrContains(absl::AsciiStrToLower(output), "permission denied")) << output;
  auto admin = v1::Admin::NewStub(
      grpc::CreateChannel("unix:" + daemon_.admin_socket(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::InspectStepRequest request;
  request.set_step(1);
  v1::InspectStepResponse response;
  EXPECT_TRUE(admin->InspectStep(&context, request, &response).ok());  // step 1 is still there
}

TEST_F(LocalAccessTest, AdminCallsAreServedOnTheAdminSocketOnly) {
  v1::StatusRequest request;
  v1::StatusResponse response;
  {
    auto on_agent = v1::Admin::NewStub(
        grpc::CreateChannel("unix:" + daemon_.agent_socket(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    EXPECT_EQ(on_agent->Status(&context, request, &response).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  {
    grpc::ClientContext context;
    v1::HelloRequest hello;
    v1::HelloResponse answer;
    auto agent_on_admin = v1::Agent::NewStub(
        grpc::CreateChannel("unix:" + daemon_.admin_socket(), grpc::InsecureChannelCredentials()));
    EXPECT_EQ(agent_on_admin->Hello(&context, hello, &answer).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  auto admin = v1::Admin::NewStub(
      grpc::CreateChannel("unix:" + daemon_.admin_socket(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  ASSERT_TRUE(admin->Status(&context, request, &response).ok());
  EXPECT_GT(response.pid(), 0u);
}

// CPU time the process has used (user + system), from /proc.
absl::Duration CpuTime(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
  std::istringstream fields(text.substr(text.rfind(')') + 2));
  std::vector<std::string> values((std::istream_iterator<std::string>(fields)),
                                  std::istream_iterator<std::string>());
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  return absl::Seconds((std::stod(values[11]) + std::stod(values[12])) / ticks);
}

int OpenDescriptors(pid_t pid) {
  return static_cast<int>(std::distance(
      std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd")),
      std::filesystem::directory_iterator()));
}

TEST(AcceptLoopTest, OutOfDescriptorsTheDaemonWaitsInsteadOfSpinning) {
  TestDaemon daemon{{.pool_bytes = "16MiB"}};
  ASSERT_TRUE(daemon.Start());
  // Leave the daemon two descriptors, then queue more connections than it can accept.
  rlimit original{};
  ASSERT_EQ(prlimit(daemon.pid(), RLIMIT_NOFILE, nullptr, &original), 0);
  rlimit tight = original;  // the soft limit only: raising it back needs no privilege
  tight.rlim_cur = static_cast<rlim_t>(OpenDescriptors(daemon.pid()) + 2);
  ASSERT_EQ(prlimit(daemon.pid(), RLIMIT_NOFILE, &tight, nullptr), 0);
  std::vector<int> connections;
  for (int i = 0; i < 16; ++i) {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, daemon.admin_socket().c_str(), sizeof(address.sun_path) - 1);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    connections.push_back(fd);
  }
  // A spinning accept loop burns a core while connections wait in the backlog; a resting one
  // wakes ten times a second.
  const absl::Duration before = CpuTime(daemon.pid());
  const absl::Time start = absl::Now();
  while (absl::Now() - start < absl::Seconds(1)) {
    poll(nullptr, 0, 100);  // a measurement window, not synchronisation
  }
  const absl::Duration used = CpuTime(daemon.pid()) - before;
  EXPECT_LT(used, absl::Milliseconds(300)) << "the daemon used " << used << " of CPU in 1 s";
  for (int fd : connections) close(fd);
  ASSERT_EQ(prlimit(daemon.pid(), RLIMIT_NOFILE, &original, nullptr), 0);
  auto admin = v1::Admin::NewStub(
      grpc::CreateChannel("unix:" + daemon.admin_socket(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 30s);
  v1::StatusRequest request;
  v1::StatusResponse response;
  EXPECT_TRUE(admin->Status(&context, request, &response).ok());  // and it serves on
  EXPECT_TRUE(daemon.running());
}

}  // namespace
}  // namespace moesnap
