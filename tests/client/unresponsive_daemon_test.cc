// A daemon that answers nothing (stopped, as a host short of memory or a stuck disk can leave it)
// costs the training loop one call's timeout, not one every step: the client's later calls are
// refused at once until the daemon answers a health check again, and then it snapshots as before. A
// wait ends after one call timeout, not its whole wait timeout. A call that ran out of time while
// the daemon answers refuses nothing.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "client/src/daemon_probe.h"
#include "moesnap/client.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::TestDaemon;
using namespace std::chrono_literals;

constexpr auto kCallTimeout = 500ms;
constexpr auto kHealthCheckTimeout = 200ms;
// A bound for waits on a condition: the condition, not the time, ends them.
constexpr auto kConditionWait = 60s;

std::shared_ptr<grpc::Channel> ChannelTo(const std::string& socket) {
  return grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
}

// Polls until `probe` admits calls again.
bool AdmitsWithin(DaemonProbe& probe, std::chrono::steady_clock::duration limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!probe.Admit().ok()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

class UnresponsiveDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.Start()); }

  TestDaemon daemon_{{.pool_bytes = "64MiB"}};
};

TEST_F(UnresponsiveDaemonTest, TheProbeTellsADaemonThatAnswersNothingFromASlowCall) {
  DaemonProbe probe(ChannelTo(daemon_.agent_socket()), daemon_.agent_socket(),
                    kHealthCheckTimeout);
  probe.RanOut("WaitCommitted");  // a slow step: the daemon answers its health check
  EXPECT_OK(probe.Admit());

  ASSERT_TRUE(daemon_.Pause());
  probe.RanOut("Snapshot");
  const absl::Status refused = probe.Admit();
  EXPECT_STATUS(refused, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(refused.message(), "has answered nothing since Snapshot"))
      << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), daemon_.agent_socket())) << refused;
  daemon_.Resume();
  EXPECT_TRUE(AdmitsWithin(probe, kConditionWait));

  // A daemon that is gone answers at once ("unavailable"): that is no hang, and reconnecting to
  // the next one is the calls' business.
  daemon_.Kill(SIGKILL);
  probe.RanOut("Snapshot");
  EXPECT_OK(probe.Admit());
}

TEST_F(UnresponsiveDaemonTest, AHungDaemonCostsOneTimeoutThenCallsAreRefusedAtOnceUntilItAnswers) {
  constexpr size_t kBytes = 8 << 20;
  ClientOptions options{.socket_path = daemon_.agent_socket(), .rank = 0};
  options.call_timeout = kCallTimeout;
  absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(options);
  ASSERT_OK(connected);
  Client& client = **connected;
  absl::StatusOr<std::shared_ptr<SharedBuffer>> weights = client.AllocateHost(kBytes);
  ASSERT_OK(weights);
  ASSERT_OK(client.RegisterHostRegion({"weights", "uint8", {static_cast<int64_t>(kBytes)}},
                                      *weights, 0, kBytes));
  std::memset((*weights)->data(), 1, kBytes);
  ASSERT_OK(client.Snapshot(1));
  ASSERT_OK(client.WaitCommitted(1));

  ASSERT_TRUE(daemon_.Pause());
  EXPECT_STATUS(client.Snapshot(2), absl::StatusCode::kDeadlineExceeded);  // the one timeout
  constexpr int kSteps = 10;
  const auto started = std::chrono::steady_clock::now();
  for (int64_t step = 3; step < 3 + kSteps; ++step) {
    const absl::StatusOr<uint64_t> refused = client.Snapshot(step);
    EXPECT_STATUS(refused, absl::StatusCode::kUnavailable);
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "answered nothing since Snapshot"))
        << refused.status();
  }
  // Each would have waited out the call timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - started, kSteps * kCallTimeout / 2);

  daemon_.Resume();
  const auto deadline = std::chrono::steady_clock::now() + kConditionWait;
  int64_t step = 3 + kSteps;
  std::memset((*weights)->data(), 7, kBytes);
  while (!client.Snapshot(step).ok()) {  // refused until a health check is answered
    ASSERT_LT(std::chrono::steady_clock::now(), deadline);
    std::this_thread::sleep_for(20ms);
    ++step;
  }
  ASSERT_OK(client.WaitCommitted(step));
  absl::StatusOr<RestoreResult> restored = client.Restore();
  ASSERT_OK(restored);
  EXPECT_EQ(restored->step, step);
  const uint8_t* bytes = (*weights)->data();
  EXPECT_TRUE(std::all_of(bytes, bytes + kBytes, [](uint8_t byte) { return byte == 7; }));
}

TEST_F(UnresponsiveDaemonTest, AWaitOnADaemonThatStopsAnsweringEndsAfterOneCallTimeout) {
  ClientOptions options{.socket_path = daemon_.agent_socket(), .rank = 0};
  options.call_timeout = kCallTimeout;
  options.wait_timeout = 40 * kCallTimeout;
  absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(options);
  ASSERT_OK(connected);
  Client& client = **connected;
  absl::StatusOr<std::shared_ptr<SharedBuffer>> weights = client.AllocateHost(4096);
  ASSERT_OK(weights);
  ASSERT_OK(client.RegisterHostRegion({"weights", "uint8", {4096}}, *weights, 0, 4096));
  ASSERT_OK(client.Snapshot(1));

  ASSERT_TRUE(daemon_.Pause());
  const auto started = std::chrono::steady_clock::now();
  const absl::Status waited = client.WaitCommitted(1);
  EXPECT_FALSE(waited.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(waited) || absl::IsUnavailable(waited)) << waited;
  EXPECT_LT(std::chrono::steady_clock::now() - started, options.wait_timeout / 2);
  daemon_.Resume();
}

}  // namespace
}  // namespace moesnap
