// A daemon that answers nothing (stopped, as a host short of memory or a stuck disk can leave it)
// costs the training loop one call's timeout, not one every step: the client's later calls are
// refused at once until the daemon answers a health check again, and then it snapshots as before. A
// wait ends after one call timeout, not its whole wait timeout, and a final commit waits for the
// daemon that took its step. A call that ran out of time while the daemon answers refuses nothing.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "absl/strings/match.h"
#include "client/src/daemon_probe.h"
#include "moesnap/client.h"
#include "tests/testing/host_trainer.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::TestDaemon;
using namespace std::chrono_literals;

// Long enough for a loaded machine to answer each call that should be answered.
constexpr auto kCallTimeout = 2s;
// A bound for waits on a condition: the condition, not the time, ends them.
constexpr auto kConditionWait = 60s;

// Polls `done` until it is true or `limit` passes.
template <typename Condition>
bool Within(std::chrono::steady_clock::duration limit, Condition done) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

bool RefusedAsUnanswering(const absl::Status& status) {
  return absl::IsUnavailable(status) && absl::StrContains(status.message(), "answered nothing");
}

class UnresponsiveDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.Start()); }

  using Trainer = testing::HostTrainer;
  // A trainer of `rank` with `bytes` of weights registered, its calls bounded by kCallTimeout.
  void ConnectTrainer(uint32_t rank, size_t bytes, Trainer* trainer,
                      std::chrono::milliseconds wait_timeout = ClientOptions().wait_timeout) {
    ClientOptions options{.socket_path = daemon_.agent_socket(), .rank = rank};
    options.call_timeout = kCallTimeout;
    options.wait_timeout = wait_timeout;
    testing::ConnectHostTrainer(options, bytes, trainer);
  }

  TestDaemon daemon_{{.pool_bytes = "64MiB"}};
};

TEST_F(UnresponsiveDaemonTest, TheProbeTellsADaemonThatServesNothingFromASlowCall) {
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel("unix:" + daemon_.agent_socket(), grpc::InsecureChannelCredentials());
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() + kConditionWait));
  DaemonProbe probe(channel, daemon_.agent_socket(), 1s, kCallTimeout);
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
  EXPECT_TRUE(Within(kConditionWait, [&] { return probe.Admit().ok(); }));

  // A daemon that is gone answers at once ("unavailable"): that is no hang, and reconnecting to
  // the next one is the calls' business.
  daemon_.Kill(SIGKILL);
  probe.RanOut("Snapshot");
  EXPECT_OK(probe.Admit());
}

TEST_F(UnresponsiveDaemonTest, AHungDaemonCostsOneTimeoutThenCallsAreRefusedAtOnceUntilItAnswers) {
  constexpr size_t kBytes = 8 << 20;
  Trainer trainer;
  ASSERT_NO_FATAL_FAILURE(ConnectTrainer(0, kBytes, &trainer));
  Client& client = *trainer.client;
  std::memset(trainer.weights->data(), 1, kBytes);
  ASSERT_OK(client.Snapshot(1));
  ASSERT_OK(client.WaitCommitted(1));

  ASSERT_TRUE(daemon_.Pause());
  EXPECT_STATUS(client.Snapshot(2), absl::StatusCode::kDeadlineExceeded);  // the one timeout
  constexpr int kSteps = 10;
  const auto started = std::chrono::steady_clock::now();
  for (int64_t step = 3; step < 3 + kSteps; ++step) {
    const absl::StatusOr<uint64_t> refused = client.Snapshot(step);
    EXPECT_TRUE(RefusedAsUnanswering(refused.status())) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "since Snapshot"))
        << refused.status();
  }
  // Each would have waited out the call timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - started, kSteps * kCallTimeout / 2);

  daemon_.Resume();
  int64_t step = 3 + kSteps;
  std::memset(trainer.weights->data(), 7, kBytes);
  // Refused until a health check is answered.
  ASSERT_TRUE(Within(kConditionWait, [&] { return client.Snapshot(++step).ok(); }));
  ASSERT_OK(client.WaitCommitted(step));
  absl::StatusOr<RestoreResult> restored = client.Restore();
  ASSERT_OK(restored);
  EXPECT_EQ(restored->step, step);
  const uint8_t* bytes = trainer.weights->data();
  EXPECT_TRUE(std::all_of(bytes, bytes + kBytes, [](uint8_t byte) { return byte == 7; }));
}

TEST_F(UnresponsiveDaemonTest, AWaitOnADaemonThatStopsAnsweringEndsAfterOneCallTimeout) {
  const std::chrono::milliseconds wait_timeout = 40 * kCallTimeout;
  Trainer trainer;
  ASSERT_NO_FATAL_FAILURE(ConnectTrainer(0, 4096, &trainer, wait_timeout));
  ASSERT_OK(trainer.client->Snapshot(1));

  ASSERT_TRUE(daemon_.Pause());
  const auto started = std::chrono::steady_clock::now();
  const absl::Status waited = trainer.client->WaitCommitted(1);
  EXPECT_FALSE(waited.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(waited) || absl::IsUnavailable(waited)) << waited;
  EXPECT_LT(std::chrono::steady_clock::now() - started, wait_timeout / 2);
  daemon_.Resume();
}

// A final commit whose wait the client refuses while the daemon serves nothing waits for that
// daemon, which still holds the step: taking it again there would be refused ("not after step 1").
TEST_F(UnresponsiveDaemonTest, ACommitWaitsForThePausedDaemonThatTookItsStep) {
  // Rank 0's step 1 commits once its replica, rank 9, takes it too. A commit bounded well below
  // the test's own time, so a failure ends it.
  Trainer replicas[2];
  for (int i = 0; i < 2; ++i) {
    ASSERT_NO_FATAL_FAILURE(ConnectTrainer(i == 0 ? 0 : 9, 64 << 10, &replicas[i], 30s));
    ASSERT_OK(replicas[i].client->SetReplicaGroup({"data-parallel", {0, 9}}));
  }
  Client& rank0 = *replicas[0].client;
  ASSERT_OK(rank0.Snapshot(1));
  ASSERT_OK(rank0.WaitCaptured(1));  // the step is taken whole; only its commit is to come

  ASSERT_TRUE(daemon_.Pause());
  std::future<absl::Status> committed =
      std::async(std::launch::async, [&] { return rank0.Commit(1); });
  ASSERT_TRUE(Within(kConditionWait, [&] {
    return RefusedAsUnanswering(rank0.LatestCommitted().status());
  }));
  daemon_.Resume();
  ASSERT_TRUE(Within(kConditionWait, [&] { return rank0.LatestCommitted().ok(); }));
  // Its commit waits on: it is not answered (before, it took the step again, refused at once).
  EXPECT_EQ(committed.wait_for(2 * kCallTimeout), std::future_status::timeout);
  ASSERT_OK(replicas[1].client->Snapshot(1));
  EXPECT_OK(committed.get());
  absl::StatusOr<std::optional<int64_t>> latest = rank0.LatestCommitted();
  ASSERT_OK(latest);
  EXPECT_EQ(*latest, 1);
}

}  // namespace
}  // namespace moesnap
