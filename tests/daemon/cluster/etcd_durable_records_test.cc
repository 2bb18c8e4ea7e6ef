// A node's record of its durable steps on a real etcd: written under no lease by the daemon that
// holds the node's member key, refused once another daemon holds that key, and read back with the
// decisions into the newest step durable on every node.
#include <gtest/gtest.h>

#include <memory>

#include "absl/time/clock.h"
#include "daemon/cluster/context.h"
#include "daemon/cluster/durable_records.h"
#include "daemon/cluster/etcd_control.h"
#include "daemon/cluster/etcd_keys.h"
#include "daemon/cluster/etcd_session.h"
#include "daemon/cluster/membership.h"
#include "daemon/cluster/node_table.h"
#include "proto/moesnap.pb.h"
#include "tests/testing/etcd_process.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

class EtcdDurableRecordsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<testing::EtcdCluster>> etcd = testing::EtcdCluster::Start();
    ASSERT_OK(etcd);
    etcd_ = *std::move(etcd);
    absl::StatusOr<std::unique_ptr<etcd::Client>> client =
        etcd::Client::Create(etcd_->ClientOptions());
    ASSERT_OK(client);
    client_ = *std::move(client);
    options_.job = "records-test";
    options_.node_count = 3;
    options_.data_units = 2;
    options_.parity_units = 1;
    options_.lease_ttl_ms = 2000;
    options_.etcd_endpoints = etcd_->endpoints();
    options_.advertise_host = "127.0.0.1";
    options_.tls.insecure = true;  // units of one node in this process, etcd in plaintext
    absl::StatusOr<std::unique_ptr<const Topology>> topology = Topology::Create(0, options_, uint64_t{64} << 20);
    ASSERT_OK(topology);
    topology_ = *std::move(topology);
    nodes_ = std::make_unique<NodeTable>(options_.node_count);
    absl::StatusOr<std::unique_ptr<EtcdSession>> session = EtcdSession::Start(options_, 0);
    ASSERT_OK(session);
    session_ = *std::move(session);
    membership_ = std::make_unique<Membership>(
        ClusterContext{topology_.get(), nodes_.get(), nullptr, nullptr}, session_.get(), keys_);
    v1::MemberRecord self;
    self.set_node_id(0);
    self.set_host("127.0.0.1");
    self.set_config_digest(options_.Digest());
    *self.mutable_shape() = ShapeOf(options_);
    membership_->Start(self);
    ASSERT_TRUE(membership_->WaitRegistered(absl::Now() + absl::Seconds(20)));
    records_ = NewEtcdDurableRecords(session_.get(), keys_, options_, 0, membership_.get());
  }

  // What etcd holds as node 0's record.
  std::vector<int64_t> Recorded() {
    absl::StatusOr<std::optional<etcd::KeyValue>> stored = client_->Get(keys_.Durable(0));
    EXPECT_OK(stored);
    if (!stored.ok() || !stored->has_value()) return {};
    EXPECT_EQ((*stored)->lease, 0) << "a record must outlive every lease";
    absl::StatusOr<std::vector<int64_t>> steps = ParseDurableRecord(**stored, 0, options_.Digest());
    EXPECT_OK(steps);
    return steps.ok() ? *steps : std::vector<int64_t>();
  }

  void Decide(int64_t step, bool committed) {
    v1::StepDecision decision;
    decision.set_step(step);
    decision.set_committed(committed);
    ASSERT_OK(client_->Put(keys_.Step(step), decision.SerializeAsString()));
  }

  const EtcdKeys keys_{"records-test"};
  std::unique_ptr<testing::EtcdCluster> etcd_;
  std::unique_ptr<etcd::Client> client_;
  ClusterOptions options_;
  std::unique_ptr<const Topology> topology_;
  std::unique_ptr<NodeTable> nodes_;
  std::unique_ptr<EtcdSession> session_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<DurableRecords> records_;
};

TEST_F(EtcdDurableRecordsTest, ARecordOutlivesTheLeaseAndDecidesWithTheDecisions) {
  ASSERT_OK(records_->Record({2, 4}));
  EXPECT_EQ(Recorded(), std::vector<int64_t>({2, 4}));
  ASSERT_OK(client_->Put(keys_.Durable(1), DurableRecordValue(1, options_.Digest(), {2, 4})));
  ASSERT_OK(client_->Put(keys_.Durable(2), DurableRecordValue(2, options_.Digest(), {2, 4})));
  absl::StatusOr<std::optional<int64_t>> oldest = records_->OldestRecorded();
  ASSERT_OK(oldest);
  EXPECT_EQ(*oldest, 2);
  absl::StatusOr<durable::DurableEverywhere> everywhere = records_->NewestEverywhere();
  ASSERT_OK(everywhere);
  EXPECT_EQ(everywhere->step, std::nullopt) << everywhere->reason;  // nothing decided yet
  Decide(2, true);
  Decide(4, false);
  everywhere = records_->NewestEverywhere();
  ASSERT_OK(everywhere);
  EXPECT_EQ(everywhere->step, 2) << everywhere->reason;
  // The daemon goes (its lease revoked, as at a stop): its member key goes, its record stays.
  records_.reset();
  membership_.reset();
  session_.reset();
  EXPECT_EQ(client_->Get(keys_.Member(0))->has_value(), false);
  EXPECT_EQ(Recorded(), std::vector<int64_t>({2, 4}));
}

TEST_F(EtcdDurableRecordsTest, ADaemonThatNoLongerHoldsItsNodeCannotRecord) {
  ASSERT_OK(records_->Record({2, 4}));
  // Another daemon holds node 0 now (this one's key went, a replacement's came).
  ASSERT_OK(client_->Delete(keys_.Member(0)));
  ASSERT_OK(client_->Put(keys_.Member(0), "the replacement's record"));
  EXPECT_STATUS(records_->Record({2, 4, 6}), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Recorded(), std::vector<int64_t>({2, 4}));
}

}  // namespace
}  // namespace moesnap::daemon::cluster
