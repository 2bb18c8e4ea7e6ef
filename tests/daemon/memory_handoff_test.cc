// The memory handoff against a real moesnapd: hostile requests are refused and the daemon serves
// on; a trainer that exits releases its registrations, and its rank's next process takes the
// memory it left (in ordinary or huge pages); a client rides through a daemon restart, and makes a reconnection that failed
// half-way again at its next call; a capture its trainer gave up waiting for is never restored; a
// client without a daemon fails at once, naming the socket.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <thread>
#include <tuple>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "common/descriptor_passing.h"
#include "common/memory_handoff_wire.h"
#include "moesnap/client.h"
#include "proto/moesnap.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/host_trainer.h"
#include "tests/testing/http_client.h"
#include "tests/testing/huge_pages.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

namespace wire = ::moesnap::memory_handoff;
using testing::BinaryPath;
using testing::ChildProcess;
using testing::TestDaemon;
using namespace std::chrono_literals;

int ConnectSeqpacket(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  return fd;
}

// Sends `request` with `fds` attached and returns the daemon's answer (code, message).
template <typename Message>
std::pair<uint32_t, std::string> Exchange(int connection, const Message& request,
                                          const std::vector<int>& fds, size_t request_bytes) {
  EXPECT_EQ(SendWithDescriptors(connection, &request, request_bytes, fds.data(), fds.size(),
                                MSG_NOSIGNAL),
            static_cast<ssize_t>(request_bytes));
  char packet[sizeof(wire::Response) + wire::kMaxMessageBytes];
  const ssize_t received = recv(connection, packet, sizeof(packet), 0);
  if (received < static_cast<ssize_t>(sizeof(wire::Response))) return {~0u, "no answer"};
  wire::Response response;
  std::memcpy(&response, packet, sizeof(response));
  return {response.code, std::string(packet + sizeof(response), received - sizeof(response))};
}

int Memfd(size_t bytes) {
  const int fd = memfd_create("handoff-test", MFD_CLOEXEC);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  return fd;
}

class MemoryHandoffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(daemon_.Start());
    agent_ = v1::Agent::NewStub(
        grpc::CreateChannel("unix:" + daemon_.agent_socket(), grpc::InsecureChannelCredentials()));
  }

  v1::HelloResponse Hello(uint32_t rank) {
    grpc::ClientContext context;
    v1::HelloRequest request;
    request.set_rank(rank);
    v1::HelloResponse response;
    EXPECT_TRUE(agent_->Hello(&context, request, &response).ok());
    sessions_[rank] = response.session();
    return response;
  }

  // A call of `rank`'s trainer: it presents the session its Hello returned.
  void Present(grpc::ClientContext& context, uint32_t rank) {
    context.AddMetadata(wire::kSessionMetadataKey, sessions_[rank]);
  }

  grpc::Status SnapshotOf(uint32_t rank, int64_t step) {
    grpc::ClientContext context;
    Present(context, rank);
    v1::SnapshotRequest request;
    request.set_rank(rank);
    request.set_step(step);
    v1::SnapshotResponse response;
    return agent_->Snapshot(&context, request, &response);
  }

  std::string MemorySocket() const { return daemon_.agent_socket() + wire::kSocketSuffix; }

  // A process of rank 0 through the client library: its "weights", a host region of `bytes`.
  using Trainer = testing::HostTrainer;
  void ConnectTrainer(size_t bytes, Trainer* trainer,
                      std::chrono::milliseconds wait_timeout = ClientOptions().wait_timeout) {
    ClientOptions options{.socket_path = daemon_.agent_socket(), .rank = 0};
    options.wait_timeout = wait_timeout;
    testing::ConnectHostTrainer(options, bytes, trainer);
  }

  // The trainer's weights filled with `step`'s number, snapshotted as `step` and committed.
  static void CommitFilled(Trainer& trainer, int64_t step) {
    std::memset(trainer.weights->data(), static_cast<int>(step), trainer.weights->size());
    ASSERT_OK(trainer.client->Snapshot(step));
    ASSERT_OK(trainer.client->WaitCommitted(step));
  }

  TestDaemon daemon_{{.pool_bytes = "64MiB"}};
  std::unique_ptr<v1::Agent::Stub> agent_;
  std::map<uint32_t, std::string> sessions_;  // by rank
};

TEST_F(MemoryHandoffTest, HostileRequestsAreRefusedAndTheDaemonServesOn) {
  const v1::HelloResponse hello = Hello(1);
  EXPECT_EQ(hello.memory_socket(), MemorySocket());
  wire::Request request;
  request.files = 1;
  std::memcpy(request.session, hello.session().data(), wire::kSessionBytes);

  {  // not a shared-memory file
    const int connection = ConnectSeqpacket(MemorySocket());
    int pipe_ends[2];
    ASSERT_EQ(pipe(pipe_ends), 0);
    const auto [code, message] = Exchange(connection, request, {pipe_ends[0]}, sizeof(request));
    EXPECT_EQ(code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument)) << message;
    EXPECT_TRUE(absl::StrContains(message, "not a shared-memory file")) << message;
    close(pipe_ends[0]);
    close(pipe_ends[1]);
    close(connection);
  }
  {  // a token no session has
    const int connection = ConnectSeqpacket(MemorySocket());
    wire::Request forged = request;
    forged.session[0] ^= 0xff;
    const int file = Memfd(4096);
    const auto [code, message] = Exchange(connection, forged, {file}, sizeof(forged));
    EXPECT_EQ(code, static_cast<uint32_t>(absl::StatusCode::kNotFound)) << message;
    close(file);
    close(connection);
  }
  {  // announces two files, carries one; then a short, malformed request
    const int connection = ConnectSeqpacket(MemorySocket());
    wire::Request lying = request;
    lying.files = 2;
    const int file = Memfd(4096);
    EXPECT_EQ(Exchange(connection, lying, {file}, sizeof(lying)).first,
              static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
    close(connection);
    const int second = ConnectSeqpacket(MemorySocket());
    EXPECT_EQ(Exchange(second, request, {file}, 7).first,
              static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
    close(file);
    close(second);
  }
  {  // asks for a kept file on a connection not bound to its session, or with files attached
    wire::AdoptRequest adopt;
    adopt.bytes = 1 << 20;
    std::memcpy(adopt.session, hello.session().data(), wire::kSessionBytes);
    const int unbound = ConnectSeqpacket(MemorySocket());
    auto [code, message] = Exchange(unbound, adopt, {}, sizeof(adopt));
    EXPECT_EQ(code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument)) << message;
    EXPECT_TRUE(absl::StrContains(message, "bound to the session")) << message;
    close(unbound);
    // (rank 3's session: closing a bound connection ends its session)
    const v1::HelloResponse other = Hello(3);
    std::memcpy(adopt.session, other.session().data(), wire::kSessionBytes);
    wire::Request bind;
    std::memcpy(bind.session, other.session().data(), wire::kSessionBytes);
    const int bound = ConnectSeqpacket(MemorySocket());
    ASSERT_EQ(Exchange(bound, bind, {}, sizeof(bind)).first, 0u);
    // A second connection for the same session (a process that copied the token) is refused:
    // a session has one memory connection, whose peer is the process watched.
    const int second = ConnectSeqpacket(MemorySocket());
    std::tie(code, message) = Exchange(second, bind, {}, sizeof(bind));
    EXPECT_EQ(code, static_cast<uint32_t>(absl::StatusCode::kFailedPrecondition)) << message;
    close(second);
    const int file = Memfd(4096);
    std::tie(code, message) = Exchange(bound, adopt, {file}, sizeof(adopt));
    EXPECT_EQ(code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument)) << message;
    close(file);
    close(bound);
  }
  {  // a region past the end of the memory handed over
    const int connection = ConnectSeqpacket(MemorySocket());
    const int file = Memfd(4096);
    ASSERT_EQ(Exchange(connection, request, {file}, sizeof(request)).first, 0u);
    close(file);
    grpc::ClientContext context;
    Present(context, 1);
    v1::RegisterRegionsRequest registration;
    registration.set_rank(1);
    v1::RegionSpec* spec = registration.add_regions();
    spec->set_name("weights");
    spec->set_device(v1::DEVICE_HOST);
    spec->set_bytes(4096);
    spec->mutable_handle()->set_memory(1);
    spec->mutable_handle()->set_shm_offset(64);
    v1::RegisterRegionsResponse response;
    const grpc::Status status = agent_->RegisterRegions(&context, registration, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    close(connection);
  }

  // The daemon still serves a real trainer.
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.socket_path = daemon_.agent_socket(), .rank = 2});
  ASSERT_OK(client);
  absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = (*client)->AllocateHost(1 << 16);
  ASSERT_OK(buffer);
  std::memset((*buffer)->data(), 0x5c, 1 << 16);
  ASSERT_OK((*client)->RegisterHostRegion({"weights", "uint8", {1 << 16}}, *buffer, 0, 1 << 16));
  ASSERT_OK((*client)->Snapshot(1));
  ASSERT_OK((*client)->WaitCommitted(1));
  std::memset((*buffer)->data(), 0, 1 << 16);
  ASSERT_OK((*client)->Restore());
  EXPECT_EQ((*buffer)->data()[(1 << 16) - 1], 0x5c);
}

TEST_F(MemoryHandoffTest, ATrainerThatExitsReleasesItsRegistrations) {
  const v1::HelloResponse hello = Hello(5);
  const int connection = ConnectSeqpacket(MemorySocket());
  wire::Request request;
  request.files = 1;
  std::memcpy(request.session, hello.session().data(), wire::kSessionBytes);
  const int file = Memfd(4096);
  ASSERT_EQ(Exchange(connection, request, {file}, sizeof(request)).first, 0u);
  close(file);
  {
    grpc::ClientContext context;
    Present(context, 5);
    v1::RegisterRegionsRequest registration;
    registration.set_rank(5);
    v1::RegionSpec* spec = registration.add_regions();
    spec->set_name("weights");
    spec->set_device(v1::DEVICE_HOST);
    spec->set_bytes(4096);
    spec->mutable_handle()->set_memory(1);
    v1::RegisterRegionsResponse response;
    ASSERT_TRUE(agent_->RegisterRegions(&context, registration, &response).ok());
  }
  ASSERT_TRUE(SnapshotOf(5, 1).ok());
  close(connection);  // the trainer exits
  // Its session ends with the connection (and with it the rank's registrations): the session no
  // longer acts for rank 5.
  grpc::Status status;
  for (auto deadline = std::chrono::steady_clock::now() + 20s;
       std::chrono::steady_clock::now() < deadline; std::this_thread::sleep_for(10ms)) {
    status = SnapshotOf(5, 2);
    // Until then step 1 may still be capturing (FAILED_PRECONDITION).
    if (status.error_code() == grpc::StatusCode::PERMISSION_DENIED) break;
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "not current")) << status.error_message();
}

// Runs moesnap-test-trainer as rank 2 (8 regions of 1 MiB) to its end; returns its output.
std::string RunTrainer(const TestDaemon& daemon, const std::string& mode, int64_t steps) {
  ChildProcess trainer({BinaryPath("moesnap-test-trainer"), "--socket", daemon.agent_socket(),
                        "--rank", "2", "--regions", "8", "--region-bytes", "1048576", "--steps",
                        std::to_string(steps), "--mode", mode});
  std::string output;
  while (std::optional<std::string> line = trainer.ReadLine(60s)) output += *line + "\n";
  EXPECT_EQ(trainer.Wait(60s), 0) << output;
  return output;
}

TEST_F(MemoryHandoffTest, ARanksNextProcessTakesTheMemoryItsExitedProcessLeft) {
  constexpr size_t kBytes = 8 << 20;
  const std::string first = RunTrainer(daemon_, "train", 3);
  ASSERT_TRUE(absl::StrContains(first, "done 3")) << first;
  // Its process has exited (reaped): the next one of rank 2 takes its memory, restores into it
  // and checks every byte.
  const std::string second = RunTrainer(daemon_, "train", 6);
  EXPECT_TRUE(absl::StrContains(second, "verified step 3\n")) << second;
  EXPECT_TRUE(absl::StrContains(second, "into adopted memory")) << second;
  EXPECT_TRUE(absl::StrContains(second, "done 6")) << second;

  // What is handed on is exactly what the exited process held (step 6, as a restore writes it),
  // and only a file of the size asked for.
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.socket_path = daemon_.agent_socket(), .rank = 2});
  ASSERT_OK(client);
  for (const size_t other_size : {kBytes / 2, kBytes - 1000}) {
    absl::StatusOr<std::shared_ptr<SharedBuffer>> other = (*client)->AdoptHost(other_size);
    ASSERT_OK(other);
    EXPECT_EQ(*other, nullptr) << other_size;
  }
  absl::StatusOr<std::shared_ptr<SharedBuffer>> left = (*client)->AdoptHost(kBytes);
  ASSERT_OK(left);
  ASSERT_NE(*left, nullptr);
  absl::StatusOr<std::shared_ptr<SharedBuffer>> restored = (*client)->AllocateHost(kBytes);
  ASSERT_OK(restored);
  for (int region = 0; region < 8; ++region) {
    const std::string name = absl::StrCat("layer0.expert", region, ".master");
    ASSERT_OK((*client)->RegisterHostRegion({name, "uint8", {1 << 20}}, *restored,
                                            region << 20, 1 << 20));
  }
  absl::StatusOr<RestoreResult> result = (*client)->Restore();
  ASSERT_OK(result);
  EXPECT_EQ(result->step, 6);
  EXPECT_EQ(std::memcmp((*left)->data(), (*restored)->data(), kBytes), 0);

  // A session that ends while its process still runs (this one) leaves nothing to take: no two
  // live processes share memory through the daemon.
  client->reset();
  absl::StatusOr<std::unique_ptr<Client>> again =
      Client::Connect({.socket_path = daemon_.agent_socket(), .rank = 2});
  ASSERT_OK(again);
  absl::StatusOr<std::shared_ptr<SharedBuffer>> taken = (*again)->AdoptHost(kBytes);
  ASSERT_OK(taken);
  EXPECT_EQ(*taken, nullptr);
}

// The same in huge pages (MOESNAP_HUGE_PAGES=1): the next process takes the huge-page file, also
// when it asks for bytes that are not whole pages (the file holds them rounded up, where a file of
// ordinary pages is handed on for exactly its size only), and the daemon's metrics count the
// memory as huge pages.
TEST_F(MemoryHandoffTest, ARanksNextProcessTakesTheHugePagesItsExitedProcessLeft) {
  constexpr size_t kBytes = 8 << 20;
  absl::StatusOr<std::unique_ptr<testing::HugePageReservation>> reserved =
      testing::HugePageReservation::ReserveForTest(
          2 * kBytes / testing::HugePageReservation::kTestPageBytes);
  if (!reserved.ok()) GTEST_SKIP() << reserved.status();
  const std::string pages = absl::StrCat(testing::HugePageReservation::PageBytes());
  ASSERT_EQ(setenv(SharedBuffer::kHugePagesVariable, "1", 1), 0);
  absl::Cleanup unset = [] { unsetenv(SharedBuffer::kHugePagesVariable); };
  const std::string first = RunTrainer(daemon_, "train", 3);
  ASSERT_TRUE(absl::StrContains(first, "done 3")) << first;
  const std::string second = RunTrainer(daemon_, "train", 6);
  EXPECT_TRUE(absl::StrContains(second, "verified step 3\n")) << second;
  EXPECT_TRUE(absl::StrContains(second, absl::StrCat("into adopted memory in pages of ", pages,
                                                     " bytes")))
      << second;

  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.socket_path = daemon_.agent_socket(), .rank = 2});
  ASSERT_OK(client);
  absl::StatusOr<std::shared_ptr<SharedBuffer>> left = (*client)->AdoptHost(kBytes - 1000);
  ASSERT_OK(left);
  ASSERT_NE(*left, nullptr);
  EXPECT_EQ((*left)->size(), kBytes - 1000);
  EXPECT_EQ((*left)->file_bytes(), kBytes);
  EXPECT_EQ(absl::StrCat((*left)->page_bytes()), pages);
  absl::StatusOr<testing::HttpReply> metrics = testing::HttpGet(daemon_.http_port(), "/metrics");
  ASSERT_OK(metrics);
  EXPECT_TRUE(absl::StrContains(metrics->body,
                                absl::StrCat("moesnap_trainer_memory_bytes{pages=\"huge\"} ", kBytes)))
      << metrics->body;
}

TEST_F(MemoryHandoffTest, AClientRidesThroughADaemonRestart) {
  constexpr size_t kBytes = 8 << 20;
  Trainer trainer;
  ASSERT_NO_FATAL_FAILURE(ConnectTrainer(kBytes, &trainer));
  Client& client = *trainer.client;
  ASSERT_NO_FATAL_FAILURE(CommitFilled(trainer, 1));
  std::memset(trainer.weights->data(), 2, kBytes);
  ASSERT_OK(client.Snapshot(2));
  daemon_.Kill(SIGKILL);  // an upgrade, or a crash that systemd restarts
  ASSERT_TRUE(daemon_.Start());

  // Step 2 either committed before the kill, or its capture went with the daemon: either way the
  // trainer may go on, and a lost step is reported, never an error.
  ASSERT_OK(client.WaitCaptured(2));
  absl::StatusOr<std::optional<int64_t>> latest = client.LatestCommitted();
  ASSERT_OK(latest);
  const std::vector<std::pair<int64_t, std::string>> lost = client.TakeSkippedSteps();
  if (**latest == 1) {
    ASSERT_EQ(lost.size(), 1u);
    EXPECT_EQ(lost[0].first, 2);
    EXPECT_TRUE(absl::StrContains(lost[0].second, "restarted")) << lost[0].second;
  } else {
    EXPECT_EQ(**latest, 2);
    EXPECT_TRUE(lost.empty());
  }
  // Registered again on the new daemon by the client itself.
  ASSERT_NO_FATAL_FAILURE(CommitFilled(trainer, 3));

  Trainer fresh;
  ASSERT_NO_FATAL_FAILURE(ConnectTrainer(kBytes, &fresh));
  absl::StatusOr<RestoreResult> result = fresh.client->Restore();
  ASSERT_OK(result);
  EXPECT_EQ(result->step, 3);
  EXPECT_EQ(std::memcmp(fresh.weights->data(), trainer.weights->data(), kBytes), 0);
}

// A client whose reconnection to a restarted daemon failed after its Hello (the daemon refused a
// file it handed over again) connects again at its next call, instead of staying on a session that
// holds none of its regions.
TEST_F(MemoryHandoffTest, AReconnectionThatFailedHalfWayIsMadeAgainAtTheNextCall) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  constexpr size_t kBytes = 8 << 20;
  Trainer trainer;
  ASSERT_NO_FATAL_FAILURE(ConnectTrainer(kBytes, &trainer));
  Client& client = *trainer.client;
  ASSERT_NO_FATAL_FAILURE(CommitFilled(trainer, 1));
  daemon_.Kill(SIGKILL);
  ASSERT_TRUE(daemon_.Start());

  // The restarted daemon refuses the file while another user owns it: the reconnection fails.
  ASSERT_EQ(fchown(trainer.weights->fd(), geteuid() + 4242, static_cast<gid_t>(-1)), 0);
  EXPECT_STATUS(client.Snapshot(2), absl::StatusCode::kPermissionDenied);
  ASSERT_EQ(fchown(trainer.weights->fd(), geteuid(), static_cast<gid_t>(-1)), 0);
  std::memset(trainer.weights->data(), 3, kBytes);
  absl::StatusOr<uint64_t> taken = client.Snapshot(3);
  ASSERT_OK(taken);
  EXPECT_EQ(*taken, kBytes);
  ASSERT_OK(client.WaitCommitted(3));
}

// A trainer that goes on without hearing that a capture ended (its wait ran out, the daemon slow
// or paused; or it closed its client) writes its memory while the copy may still read it: that
// capture is never committed, so no restore gives back a state that mixes two steps.
class GaveUpCaptureTest : public MemoryHandoffTest, public ::testing::WithParamInterface<bool> {};

TEST_P(GaveUpCaptureTest, ACaptureTheTrainerGaveUpOnIsNeverRestoredMixed) {
  const bool close_client = GetParam();
  constexpr size_t kBytes = 48 << 20;
  Trainer trainer;
  ASSERT_NO_FATAL_FAILURE(ConnectTrainer(kBytes, &trainer, /*wait_timeout=*/100ms));
  std::memset(trainer.weights->data(), 1, kBytes);
  absl::StatusOr<uint64_t> taken = trainer.client->Snapshot(1);
  ASSERT_OK(taken);
  ASSERT_EQ(*taken, kBytes);
  ASSERT_TRUE(daemon_.Pause());  // mid-copy, as a host short of CPU can leave it
  if (close_client) {
    trainer.client.reset();
  } else {
    EXPECT_STATUS(trainer.client->WaitCaptured(1), absl::StatusCode::kDeadlineExceeded);
  }
  std::memset(trainer.weights->data(), 2, kBytes);  // the next step, while the copy may still run
  daemon_.Resume();

  // The rank's next process: its restore waits for the capture to end. Had the copy ended before
  // the pause, step 1 is whole; else it was aborted, and nothing is committed.
  Trainer fresh;
  ASSERT_NO_FATAL_FAILURE(ConnectTrainer(kBytes, &fresh));
  absl::StatusOr<RestoreResult> restored = fresh.client->Restore();
  if (restored.ok()) {
    EXPECT_EQ(restored->step, 1);
    const uint8_t* bytes = fresh.weights->data();
    EXPECT_TRUE(std::all_of(bytes, bytes + kBytes, [](uint8_t byte) { return byte == 1; }));
  } else {
    EXPECT_STATUS(restored, absl::StatusCode::kNotFound);
  }
}

INSTANTIATE_TEST_SUITE_P(WaitRanOutOrClientClosed, GaveUpCaptureTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "ClientClosed" : "WaitRanOut";
                         });

TEST(ClientConnectTest, WithoutADaemonItFailsAtOnceNamingTheSocket) {
  char directory[] = "/tmp/moesnap-connect-XXXXXX";
  ASSERT_NE(mkdtemp(directory), nullptr);
  const std::string missing = std::string(directory) + "/agent.sock";
  const auto started = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect({.socket_path = missing});
  ASSERT_STATUS(client, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(client.status().message(), missing)) << client.status();

  // A socket file left by a daemon that died: nobody listens.
  const int stale = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, missing.c_str(), sizeof(address.sun_path) - 1);
  ASSERT_EQ(bind(stale, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  close(stale);
  client = Client::Connect({.socket_path = missing});
  ASSERT_STATUS(client, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(client.status().message(), missing)) << client.status();
  // Far below the 30 s call timeout that used to run out first.
  EXPECT_LT(std::chrono::steady_clock::now() - started, 10s);
  unlink(missing.c_str());
  rmdir(directory);
}

}  // namespace
}  // namespace moesnap
