// The etcd client against a real three-member etcd that loses members: a watch resumes on another
// member without losing or repeating an event when its member is killed or stopped, a killed member
// comes back and catches up, and a stream of fenced write-once decisions goes on through the other
// members when the raft leader is SIGKILLed in the middle of it, with no decision lost or written
// twice.
#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/etcd/election.h"
#include "daemon/etcd/etcd_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/etcd_process.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::etcd {
namespace {

using ::moesnap::testing::EtcdCluster;

class FailoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster = EtcdCluster::Start({.members = 3});
    ASSERT_OK(cluster);
    etcd_ = *std::move(cluster);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(etcd_->ClientOptions());
    ASSERT_OK(client);
    client_ = *std::move(client);
  }

  std::unique_ptr<EtcdCluster> etcd_;
  std::unique_ptr<Client> client_;
};

TEST_F(FailoverTest, WatchResumesAfterTheMemberItUsedIsKilled) {
  // Writes to three members are write-once: a leader election may start at any time on a loaded
  // machine, and only a write-once can be resent after an attempt with an unknown outcome.
  const absl::StatusOr<KeyValue> written = client_->WriteOnce("w/0", "0");
  ASSERT_OK(written);
  const int64_t start = written->mod_revision;
  // Nothing failed yet, so the watch streams from the first endpoint, member 0.
  absl::StatusOr<std::unique_ptr<Watcher>> watcher = client_->WatchPrefix("w/", start);
  ASSERT_OK(watcher);
  absl::StatusOr<WatchEvent> first = (*watcher)->Next(absl::Seconds(10));
  ASSERT_OK(first);
  EXPECT_EQ(first->kv.key, "w/0");

  ASSERT_OK(etcd_->Kill(0));
  constexpr int kWrites = 20;
  for (int i = 1; i <= kWrites; ++i) {
    ASSERT_OK(client_->WriteOnce(absl::StrCat("w/", i), std::to_string(i)));
  }
  int64_t previous = first->kv.mod_revision;
  for (int i = 1; i <= kWrites; ++i) {
    absl::StatusOr<WatchEvent> event = (*watcher)->Next(absl::Seconds(20));
    ASSERT_OK(event);
    EXPECT_EQ(event->kv.key, absl::StrCat("w/", i));  // in order, none lost, none twice
    EXPECT_GT(event->kv.mod_revision, previous);
    previous = event->kv.mod_revision;
  }
  EXPECT_STATUS((*watcher)->Next(absl::Milliseconds(200)), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE((*watcher)->resumes(), 1);
}

TEST_F(FailoverTest, WatchMovesOnWhenTheMemberItUsedStopsAnswering) {
  // A stopped member keeps its connections open: only the watcher's own check notices it.
  Options options = etcd_->ClientOptions();
  options.attempt_timeout = absl::Milliseconds(500);
  absl::StatusOr<std::unique_ptr<Client>> watching = Client::Create(options);
  ASSERT_OK(watching);
  // Writes to three members are write-once: a leader election may start at any time on a loaded
  // machine, and only a write-once can be resent after an attempt with an unknown outcome.
  const absl::StatusOr<KeyValue> written = client_->WriteOnce("w/0", "0");
  ASSERT_OK(written);
  const int64_t start = written->mod_revision;
  absl::StatusOr<std::unique_ptr<Watcher>> watcher = (*watching)->WatchPrefix("w/", start);
  ASSERT_OK(watcher);
  absl::StatusOr<WatchEvent> first = (*watcher)->Next(absl::Seconds(10));
  ASSERT_OK(first);

  ASSERT_OK(etcd_->Stop(0));
  Options survivors = etcd_->ClientOptions();
  survivors.endpoints = {etcd_->endpoint(1), etcd_->endpoint(2)};
  absl::StatusOr<std::unique_ptr<Client>> writer = Client::Create(survivors);
  ASSERT_OK(writer);
  // WriteOnce, not Put: the stopped member may be the raft leader, and a write sent while the
  // others elect a new one has an unknown outcome, which only a write-once can resend safely.
  ASSERT_OK((*writer)->WriteOnce("w/1", "1"));
  // Sooner than gRPC's keep-alive pings (10 s + 5 s) would find the connection dead.
  absl::StatusOr<WatchEvent> event = (*watcher)->Next(absl::Seconds(8));
  ASSERT_OK(event);
  EXPECT_EQ(event->kv.key, "w/1");
  EXPECT_GE((*watcher)->resumes(), 1);
  ASSERT_OK(etcd_->Continue(0));
}

TEST_F(FailoverTest, KilledMemberRestartsAndCatchesUp) {
  ASSERT_OK(etcd_->Kill(1));
  const absl::StatusOr<KeyValue> written = client_->WriteOnce("while-down", "x");
  ASSERT_OK(written);
  ASSERT_OK(etcd_->Restart(1));
  ASSERT_OK(etcd_->WaitHealthy(absl::Seconds(15)));

  // The restarted member alone serves the write it missed.
  Options only_restarted = etcd_->ClientOptions();
  only_restarted.endpoints = {etcd_->endpoint(1)};
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(only_restarted);
  ASSERT_OK(client);
  const absl::StatusOr<std::optional<KeyValue>> read = (*client)->Get("while-down");
  ASSERT_OK(read);
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ((*read)->mod_revision, written->mod_revision);
}

TEST_F(FailoverTest, FencedDecisionsGoOnWhenTheEtcdLeaderIsKilled) {
  // The client talks to the raft leader first, so the kill breaks its own connection mid-call.
  const absl::StatusOr<int> leader = etcd_->Leader();
  ASSERT_OK(leader);
  Options options = etcd_->ClientOptions();
  std::rotate(options.endpoints.begin(), options.endpoints.begin() + *leader,
              options.endpoints.end());
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  ASSERT_OK(client);

  // A TTL longer than the election on a loaded two-core machine can take (several seconds without
  // a leader were seen while other tests ran): what is tested is that the lease survives it.
  const absl::StatusOr<Lease> lease = (*client)->GrantLease(absl::Seconds(15));
  ASSERT_OK(lease);
  absl::StatusOr<std::unique_ptr<LeaseKeeper>> keeper = (*client)->KeepAlive(*lease);
  ASSERT_OK(keeper);
  Election election(**client, "/job/coordinator");
  const absl::StatusOr<Leadership> coordinator =
      election.Campaign("node-0", "", lease->id, absl::Seconds(10));
  ASSERT_OK(coordinator);

  // One decision per step, fenced by the coordinator's token, as the cluster will write them. The
  // etcd leader is killed while they stream; the stream goes on for 30 more steps after the kill.
  constexpr int kStepsBeforeKill = 20;
  constexpr int kStepsAfterKill = 30;
  std::atomic<int> decided{0};
  std::atomic<bool> killed{false};
  std::vector<absl::Status> failures;
  std::thread writer([&] {
    int after_kill = 0;
    for (int step = 1; after_kill < kStepsAfterKill && step <= 10000; ++step) {
      const std::string value = absl::StrCat("commit ", step);
      absl::StatusOr<KeyValue> stored =
          (*client)->WriteOnce(absl::StrCat("/job/step/", step), value, coordinator->fence());
      if (!stored.ok()) {
        failures.push_back(stored.status());
      } else if (stored->value != value) {
        failures.push_back(absl::InternalError("step " + std::to_string(step) + " holds '" +
                                               stored->value + "', not '" + value + "'"));
      }
      if (killed.load()) ++after_kill;
      decided.store(step);
    }
  });
  while (decided.load() < kStepsBeforeKill) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_OK(etcd_->Kill(*leader));
  killed.store(true);
  writer.join();
  const int steps_written = decided.load();

  for (const absl::Status& failure : failures) ADD_FAILURE() << failure;
  const absl::StatusOr<RangeResult> steps = (*client)->GetPrefix(
      "/job/step/", RangeOptions{.order = RangeOptions::Order::kCreateAscending});
  ASSERT_OK(steps);
  ASSERT_EQ(steps->kvs.size(), static_cast<size_t>(steps_written));
  for (int step = 1; step <= steps_written; ++step) {
    const KeyValue& kv = steps->kvs[step - 1];  // in the order they were decided
    EXPECT_EQ(kv.key, absl::StrCat("/job/step/", step));
    EXPECT_EQ(kv.value, absl::StrCat("commit ", step));
    EXPECT_EQ(kv.version, 1);  // written once
  }
  // The coordinator's lease lived through the failover, and the client now talks to a survivor.
  EXPECT_OK((*keeper)->status());
  const absl::StatusOr<MemberStatus> status = (*client)->Status();
  ASSERT_OK(status);
  EXPECT_NE(status->endpoint, etcd_->endpoint(*leader));
}

}  // namespace
}  // namespace moesnap::etcd
