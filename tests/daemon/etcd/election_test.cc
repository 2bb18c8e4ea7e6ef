// Leader election with a fencing token against a real etcd: the next candidate leads when the
// leader's lease expires or it resigns, and the deposed leader's fenced writes fail.
#include "daemon/etcd/election.h"

#include <future>
#include <memory>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/etcd_process.h"
#include "tests/testing/http_client.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::etcd {
namespace {

using ::moesnap::testing::EtcdCluster;
using ::testing::HasSubstr;

class ElectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // 1 s leases: etcd's minimum TTL is 1.5 election timeouts.
    absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
        EtcdCluster::Start({.heartbeat_ms = 50, .election_ms = 500});
    ASSERT_OK(cluster);
    etcd_ = *std::move(cluster);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(etcd_->ClientOptions());
    ASSERT_OK(client);
    client_ = *std::move(client);
    election_ = std::make_unique<Election>(*client_, "/job/coordinator");
  }

  // A lease of `ttl` kept alive until the keeper is destroyed.
  std::pair<Lease, std::unique_ptr<LeaseKeeper>> KeptLease(absl::Duration ttl = absl::Seconds(1)) {
    absl::StatusOr<Lease> lease = client_->GrantLease(ttl);
    EXPECT_OK(lease);
    if (!lease.ok()) return {};
    absl::StatusOr<std::unique_ptr<LeaseKeeper>> keeper = client_->KeepAlive(*lease);
    EXPECT_OK(keeper);
    return {*lease, keeper.ok() ? *std::move(keeper) : nullptr};
  }

  // The raft entries etcd committed so far (etcd_server_proposals_committed_total, from its
  // /metrics): every write RPC is one, a Txn whose compare fails included; reads and lease
  // renewals are none.
  double RaftEntries() {
    const std::string endpoint = etcd_->endpoints()[0];
    uint32_t port = 0;
    EXPECT_TRUE(absl::SimpleAtoi(endpoint.substr(endpoint.rfind(':') + 1), &port)) << endpoint;
    absl::StatusOr<::moesnap::testing::HttpReply> reply =
        ::moesnap::testing::HttpGet(static_cast<uint16_t>(port), "/metrics");
    EXPECT_OK(reply);
    if (!reply.ok()) return -1;
    for (absl::string_view line : absl::StrSplit(reply->body, '\n')) {
      const std::vector<absl::string_view> fields = absl::StrSplit(line, ' ');
      double value = 0;
      if (fields.size() == 2 && fields[0] == "etcd_server_proposals_committed_total" &&
          absl::SimpleAtod(fields[1], &value)) {
        return value;
      }
    }
    ADD_FAILURE() << "etcd's /metrics has no etcd_server_proposals_committed_total";
    return -1;
  }

  std::unique_ptr<EtcdCluster> etcd_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Election> election_;
};

TEST_F(ElectionTest, NextCandidateLeadsWhenTheLeadersLeaseExpiresAndTheOldLeaderIsFencedOff) {
  auto [lease_a, keeper_a] = KeptLease();
  auto [lease_b, keeper_b] = KeptLease();
  ASSERT_NE(keeper_a, nullptr);
  ASSERT_NE(keeper_b, nullptr);
  const absl::StatusOr<Leadership> a =
      election_->Campaign("a", "host-a:7000", lease_a.id, absl::Seconds(10));
  ASSERT_OK(a);
  EXPECT_EQ(a->key, "/job/coordinator/a");

  std::future<absl::StatusOr<Leadership>> b = std::async(std::launch::async, [&, id = lease_b.id] {
    return election_->Campaign("b", "host-b:7000", id, absl::Seconds(30));
  });
  // While a's lease is kept, a leads and its fenced decisions go through.
  ASSERT_OK(client_->WriteOnce("/job/step/1", "commit by a", a->fence()));
  const absl::StatusOr<std::optional<Leader>> leader = election_->CurrentLeader();
  ASSERT_OK(leader);
  ASSERT_TRUE(leader->has_value());
  EXPECT_EQ((*leader)->name, "a");
  EXPECT_EQ((*leader)->kv.value, "host-a:7000");
  EXPECT_EQ((*leader)->token(), a->token);
  EXPECT_EQ(b.wait_for(std::chrono::seconds(0)), std::future_status::timeout);

  // a stops renewing (as a paused or partitioned process would): its key expires, b leads.
  keeper_a.reset();
  const absl::StatusOr<Leadership> b_leads = b.get();
  ASSERT_OK(b_leads);
  EXPECT_GT(b_leads->token, a->token);
  const absl::StatusOr<std::optional<Leader>> now = election_->CurrentLeader();
  ASSERT_OK(now);
  ASSERT_TRUE(now->has_value());
  EXPECT_EQ((*now)->name, "b");

  // a still believes it leads; its fenced write fails, b's goes through.
  const absl::StatusOr<KeyValue> late = client_->WriteOnce("/job/step/2", "abort by a", a->fence());
  ASSERT_STATUS(late, absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.status().message(), HasSubstr("/job/coordinator/a"));
  const absl::StatusOr<KeyValue> decided =
      client_->WriteOnce("/job/step/2", "commit by b", b_leads->fence());
  ASSERT_OK(decided);
  EXPECT_EQ(decided->value, "commit by b");
}

TEST_F(ElectionTest, ResignHandsOverAndCampaignTimesOutWhileAnotherLeads) {
  auto [lease_a, keeper_a] = KeptLease(absl::Seconds(10));
  auto [lease_b, keeper_b] = KeptLease(absl::Seconds(10));
  const absl::StatusOr<Leadership> a = election_->Campaign("a", "", lease_a.id, absl::Seconds(10));
  ASSERT_OK(a);

  const absl::StatusOr<Leadership> waiting =
      election_->Campaign("b", "", lease_b.id, absl::Milliseconds(300));
  ASSERT_STATUS(waiting, absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(waiting.status().message(), HasSubstr("waiting on '/job/coordinator/a'"));

  ASSERT_OK(election_->Resign(*a));
  EXPECT_OK(election_->Resign(*a));  // gone already: not an error
  // b's key stayed from its first Campaign: the second one resumes it.
  const absl::StatusOr<Leadership> b = election_->Campaign("b", "", lease_b.id, absl::Seconds(10));
  ASSERT_OK(b);
  EXPECT_GT(b->token, a->token);
  EXPECT_LT(b->token, a->token + 10);  // created by the first Campaign, right after a's key
  EXPECT_STATUS(client_->WriteOnce("/job/step/1", "x", a->fence()),
                absl::StatusCode::kFailedPrecondition);
}

TEST_F(ElectionTest, ACandidateCampaigningAgainWhileAnotherLeadsWritesNothing) {
  auto [lease_a, keeper_a] = KeptLease(absl::Seconds(10));
  auto [lease_b, keeper_b] = KeptLease(absl::Seconds(10));
  ASSERT_OK(election_->Campaign("a", "", lease_a.id, absl::Seconds(10)));
  // b's first campaign creates its key (one write), then waits behind a.
  ASSERT_STATUS(election_->Campaign("b", "", lease_b.id, absl::Milliseconds(100)),
                absl::StatusCode::kDeadlineExceeded);
  const double before = RaftEntries();
  ASSERT_GT(before, 0);
  // A coordinator's candidate campaigns again every few hundred milliseconds while it waits: with
  // its key in place, that is reads and a watch, never a raft entry.
  for (int attempt = 0; attempt < 5; ++attempt) {
    ASSERT_STATUS(election_->Campaign("b", "", lease_b.id, absl::Milliseconds(100)),
                  absl::StatusCode::kDeadlineExceeded);
  }
  EXPECT_EQ(RaftEntries(), before);
  // And it still takes over once a is gone.
  keeper_a.reset();
  ASSERT_OK(client_->RevokeLease(lease_a.id));
  EXPECT_OK(election_->Campaign("b", "", lease_b.id, absl::Seconds(10)));
}

TEST_F(ElectionTest, CandidateWaitsForTheKeyOfItsEarlierLife) {
  // An earlier life of candidate "a" (say a daemon that was restarted) still holds its key.
  auto [old_lease, old_keeper] = KeptLease(absl::Seconds(10));
  const absl::StatusOr<Leadership> old_life =
      election_->Campaign("a", "old", old_lease.id, absl::Seconds(10));
  ASSERT_OK(old_life);

  auto [new_lease, new_keeper] = KeptLease(absl::Seconds(10));
  const absl::StatusOr<Leadership> too_soon =
      election_->Campaign("a", "new", new_lease.id, absl::Milliseconds(300));
  ASSERT_STATUS(too_soon, absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(too_soon.status().message(), HasSubstr("held by lease"));

  ASSERT_OK(client_->RevokeLease(old_lease.id));
  const absl::StatusOr<Leadership> new_life =
      election_->Campaign("a", "new", new_lease.id, absl::Seconds(10));
  ASSERT_OK(new_life);
  EXPECT_GT(new_life->token, old_life->token);
  const absl::StatusOr<std::optional<Leader>> leader = election_->CurrentLeader();
  ASSERT_OK(leader);
  ASSERT_TRUE(leader->has_value());
  EXPECT_EQ((*leader)->kv.value, "new");
}

TEST_F(ElectionTest, CampaignFailsWhenItsOwnLeaseIsLostWhileWaiting) {
  auto [lease_a, keeper_a] = KeptLease(absl::Seconds(10));
  const absl::StatusOr<Leadership> a = election_->Campaign("a", "", lease_a.id, absl::Seconds(10));
  ASSERT_OK(a);
  const absl::StatusOr<Lease> lease_b = client_->GrantLease(absl::Seconds(10));
  ASSERT_OK(lease_b);
  std::future<absl::StatusOr<Leadership>> b = std::async(std::launch::async, [&] {
    return election_->Campaign("b", "", lease_b->id, absl::Seconds(30));
  });
  // b's key exists once its campaign waits; then b loses its lease, and a resigns.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  bool entered = false;
  while (!entered && absl::Now() < deadline) {
    absl::StatusOr<std::optional<KeyValue>> key = client_->Get("/job/coordinator/b");
    ASSERT_OK(key);
    entered = key->has_value();
  }
  ASSERT_TRUE(entered);
  ASSERT_OK(client_->RevokeLease(lease_b->id));
  ASSERT_OK(election_->Resign(*a));
  const absl::StatusOr<Leadership> result = b.get();
  ASSERT_STATUS(result, absl::StatusCode::kAborted);
  EXPECT_THAT(result.status().message(), HasSubstr("vanished"));
}

}  // namespace
}  // namespace moesnap::etcd
