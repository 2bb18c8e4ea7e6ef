// The etcd client against a real one-member etcd: reads and writes with their revisions, prefixes,
// transactions, fenced write-once decisions, leases and their keep-alive, watches, compaction,
// timeouts, and mutual TLS.
#include "daemon/etcd/etcd_client.h"

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/etcd_process.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::etcd {
namespace {

using ::moesnap::testing::EtcdCluster;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Raft timing that makes etcd accept 1 s leases (its minimum TTL is 1.5 election timeouts).
const EtcdCluster::Options kShortLeases{.heartbeat_ms = 50, .election_ms = 500};

std::vector<std::string> Keys(const std::vector<KeyValue>& kvs) {
  std::vector<std::string> keys;
  for (const KeyValue& kv : kvs) keys.push_back(kv.key);
  return keys;
}

// Polls `condition` until it holds or `timeout` passes; true if it held.
template <typename Condition>
bool Eventually(Condition condition, absl::Duration timeout = absl::Seconds(15)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return condition();
}

class EtcdClientTest : public ::testing::Test {
 protected:
  void StartEtcd(const EtcdCluster::Options& options = {}) {
    absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster = EtcdCluster::Start(options);
    ASSERT_OK(cluster);
    etcd_ = *std::move(cluster);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(etcd_->ClientOptions());
    ASSERT_OK(client);
    client_ = *std::move(client);
  }
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(StartEtcd()); }

  bool Exists(const std::string& key) {
    absl::StatusOr<std::optional<KeyValue>> read = client_->Get(key);
    EXPECT_OK(read);
    return read.ok() && read->has_value();
  }

  std::unique_ptr<EtcdCluster> etcd_;
  std::unique_ptr<Client> client_;
};

// Tests whose etcd accepts 1 s leases.
class EtcdLeaseTest : public EtcdClientTest {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(StartEtcd(kShortLeases)); }
};

TEST_F(EtcdClientTest, PutGetDeleteReportRevisions) {
  const absl::StatusOr<int64_t> created = client_->Put("k", "v1");
  ASSERT_OK(created);
  const absl::StatusOr<int64_t> changed = client_->Put("k", "v2");
  ASSERT_OK(changed);
  EXPECT_GT(*changed, *created);

  const absl::StatusOr<std::optional<KeyValue>> read = client_->Get("k");
  ASSERT_OK(read);
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ((*read)->value, "v2");
  EXPECT_EQ((*read)->create_revision, *created);
  EXPECT_EQ((*read)->mod_revision, *changed);
  EXPECT_EQ((*read)->version, 2);

  const absl::StatusOr<DeleteResult> deleted = client_->Delete("k");
  ASSERT_OK(deleted);
  EXPECT_EQ(deleted->deleted, 1);
  EXPECT_GT(deleted->revision, *changed);
  EXPECT_FALSE(Exists("k"));
  const absl::StatusOr<DeleteResult> again = client_->Delete("k");
  ASSERT_OK(again);
  EXPECT_EQ(again->deleted, 0);
}

TEST_F(EtcdClientTest, PrefixReadsAndDeletesStopAtThePrefix) {
  const std::string high(std::string("p\xff", 2));
  for (const std::string& key :
       {std::string("job/a/1"), std::string("job/a/2"), std::string("job/a"), std::string("job/a0"),
        std::string("job/b/1"), high + "\x01", std::string("q")}) {
    ASSERT_OK(client_->Put(key, "x"));
  }
  const absl::StatusOr<RangeResult> under_a = client_->GetPrefix("job/a/");
  ASSERT_OK(under_a);
  EXPECT_THAT(Keys(under_a->kvs), ElementsAre("job/a/1", "job/a/2"));
  const absl::StatusOr<RangeResult> under_high = client_->GetPrefix(high);
  ASSERT_OK(under_high);
  EXPECT_THAT(Keys(under_high->kvs), ElementsAre(high + "\x01"));

  // Newest first, one at most, and only keys created up to a revision.
  const absl::StatusOr<RangeResult> newest = client_->GetPrefix(
      "job/", RangeOptions{.order = RangeOptions::Order::kCreateDescending, .limit = 1});
  ASSERT_OK(newest);
  EXPECT_THAT(Keys(newest->kvs), ElementsAre("job/b/1"));
  EXPECT_TRUE(newest->more);
  const absl::StatusOr<RangeResult> early = client_->GetPrefix(
      "job/", RangeOptions{.order = RangeOptions::Order::kCreateAscending,
                           .max_create_revision = newest->kvs[0].create_revision - 1});
  ASSERT_OK(early);
  EXPECT_THAT(Keys(early->kvs), ElementsAre("job/a/1", "job/a/2", "job/a", "job/a0"));

  const absl::StatusOr<DeleteResult> deleted = client_->DeletePrefix("job/a/");
  ASSERT_OK(deleted);
  EXPECT_EQ(deleted->deleted, 2);
  const absl::StatusOr<RangeResult> left = client_->GetPrefix("job/");
  ASSERT_OK(left);
  EXPECT_THAT(Keys(left->kvs), ElementsAre("job/a", "job/a0", "job/b/1"));
}

TEST_F(EtcdClientTest, TxnComparesValueVersionAndRevisions) {
  const absl::StatusOr<int64_t> created = client_->Put("k", "v1");
  ASSERT_OK(created);
  const auto txn = [&](Compare compare, const std::string& value) {
    return client_->Txn(TxnRequest{.compares = {std::move(compare)},
                                   .on_success = {Operation::Put("k", value)},
                                   .on_failure = {Operation::Get("k")}});
  };
  using Relation = Compare::Relation;
  const absl::StatusOr<TxnResult> by_value = txn(Compare::Value("k", Relation::kEqual, "v1"), "v2");
  ASSERT_OK(by_value);
  EXPECT_TRUE(by_value->succeeded);
  const absl::StatusOr<TxnResult> stale_value =
      txn(Compare::Value("k", Relation::kEqual, "v1"), "v3");
  ASSERT_OK(stale_value);
  EXPECT_FALSE(stale_value->succeeded);
  ASSERT_EQ(stale_value->results.size(), 1u);
  ASSERT_EQ(stale_value->results[0].kvs.size(), 1u);
  EXPECT_EQ(stale_value->results[0].kvs[0].value, "v2");

  const absl::StatusOr<TxnResult> stale_mod =
      txn(Compare::ModRevision("k", Relation::kEqual, *created), "v3");
  ASSERT_OK(stale_mod);
  EXPECT_FALSE(stale_mod->succeeded);
  const absl::StatusOr<TxnResult> by_version =
      txn(Compare::Version("k", Relation::kEqual, 2), "v3");
  ASSERT_OK(by_version);
  EXPECT_TRUE(by_version->succeeded);
  const absl::StatusOr<TxnResult> by_create =
      txn(Compare::CreateRevision("k", Relation::kEqual, *created), "v4");
  ASSERT_OK(by_create);
  EXPECT_TRUE(by_create->succeeded);
  const absl::StatusOr<TxnResult> newer =
      txn(Compare::ModRevision("k", Relation::kGreater, by_create->revision), "v5");
  ASSERT_OK(newer);
  EXPECT_FALSE(newer->succeeded);
  const absl::StatusOr<std::optional<KeyValue>> read = client_->Get("k");
  ASSERT_OK(read);
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ((*read)->value, "v4");
  EXPECT_EQ((*read)->version, 4);
}

TEST_F(EtcdClientTest, FencedWriteOnceDecision) {
  const absl::StatusOr<int64_t> leader = client_->Put("election/n0", "n0");
  ASSERT_OK(leader);
  const Fence fence{.key = "election/n0", .create_revision = *leader};

  const absl::StatusOr<KeyValue> first = client_->WriteOnce("step/1", "commit", fence);
  ASSERT_OK(first);
  EXPECT_EQ(first->value, "commit");
  EXPECT_GT(first->create_revision, *leader);
  // The second write loses and learns the decision.
  const absl::StatusOr<KeyValue> second = client_->WriteOnce("step/1", "abort", fence);
  ASSERT_OK(second);
  EXPECT_EQ(second->value, "commit");
  EXPECT_EQ(second->create_revision, first->create_revision);

  // A new leader key supersedes the old one: writes fenced by the old revision fail.
  ASSERT_OK(client_->Delete("election/n0"));
  const absl::StatusOr<int64_t> successor = client_->Put("election/n0", "n0-again");
  ASSERT_OK(successor);
  const absl::StatusOr<KeyValue> deposed = client_->WriteOnce("step/2", "commit", fence);
  ASSERT_STATUS(deposed, absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(deposed.status().message(),
              HasSubstr("has create revision " + std::to_string(*successor)));
  EXPECT_FALSE(Exists("step/2"));
  // A decided step stays decided whoever asks.
  const absl::StatusOr<KeyValue> late = client_->WriteOnce("step/1", "abort", fence);
  ASSERT_OK(late);
  EXPECT_EQ(late->value, "commit");

  const Fence current{.key = "election/n0", .create_revision = *successor};
  ASSERT_OK(client_->WriteOnce("step/2", "abort", current));
  ASSERT_OK(client_->Delete("election/n0"));
  const absl::StatusOr<KeyValue> no_leader = client_->WriteOnce("step/3", "commit", current);
  ASSERT_STATUS(no_leader, absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(no_leader.status().message(), HasSubstr("(absent)"));
}

TEST_F(EtcdLeaseTest, ExpiryDeletesKeysAndKeepAliveKeepsThem) {
  // The kept lease is granted first, so it would expire first without its keep-alive.
  const absl::StatusOr<Lease> kept = client_->GrantLease(absl::Seconds(1));
  ASSERT_OK(kept);
  EXPECT_EQ(kept->ttl_seconds, 1);
  ASSERT_OK(client_->Put("kept", "x", kept->id));
  absl::StatusOr<std::unique_ptr<LeaseKeeper>> keeper = client_->KeepAlive(*kept);
  ASSERT_OK(keeper);
  const absl::StatusOr<Lease> left = client_->GrantLease(absl::Seconds(1));
  ASSERT_OK(left);
  ASSERT_OK(client_->Put("left", "x", left->id));

  EXPECT_TRUE(Eventually([&] { return !Exists("left"); }));
  EXPECT_TRUE(Exists("kept"));
  EXPECT_OK((*keeper)->status());
  EXPECT_GE((*keeper)->renewals(), 2);

  // Without its keeper the kept lease goes the same way.
  keeper->reset();
  EXPECT_TRUE(Eventually([&] { return !Exists("kept"); }));
  EXPECT_STATUS(client_->KeepAliveOnce(kept->id), absl::StatusCode::kNotFound);
}

TEST_F(EtcdLeaseTest, KeeperReportsARevokedLease) {
  const absl::StatusOr<Lease> lease = client_->GrantLease(absl::Seconds(5));
  ASSERT_OK(lease);
  ASSERT_OK(client_->Put("owned", "x", lease->id));
  absl::Mutex mutex;
  std::vector<absl::Status> reported;
  absl::StatusOr<std::unique_ptr<LeaseKeeper>> keeper =
      client_->KeepAlive(*lease, [&](const absl::Status& why) {
        absl::MutexLock lock(&mutex);
        reported.push_back(why);
      });
  ASSERT_OK(keeper);
  ASSERT_TRUE(Eventually([&] { return (*keeper)->renewals() >= 1; }));
  EXPECT_FALSE((*keeper)->WaitLost(absl::ZeroDuration()));

  ASSERT_OK(client_->RevokeLease(lease->id));
  EXPECT_FALSE(Exists("owned"));
  ASSERT_TRUE((*keeper)->WaitLost(absl::Seconds(10)));
  EXPECT_STATUS((*keeper)->status(), absl::StatusCode::kNotFound);
  EXPECT_THAT((*keeper)->status().message(), HasSubstr(std::to_string(lease->id)));
  absl::MutexLock lock(&mutex);
  ASSERT_EQ(reported.size(), 1u);
  EXPECT_STATUS(reported[0], absl::StatusCode::kNotFound);
  // Revoking what is gone is not an error.
  EXPECT_OK(client_->RevokeLease(lease->id));
}

TEST_F(EtcdLeaseTest, KeeperReportsLossWhenItsMemberStopsPastTheTtl) {
  const absl::StatusOr<Lease> lease = client_->GrantLease(absl::Seconds(1));
  ASSERT_OK(lease);
  ASSERT_OK(client_->Put("owned", "x", lease->id));
  absl::StatusOr<std::unique_ptr<LeaseKeeper>> keeper = client_->KeepAlive(*lease);
  ASSERT_OK(keeper);
  ASSERT_TRUE(Eventually([&] { return (*keeper)->renewals() >= 1; }));

  ASSERT_OK(etcd_->Stop(0));
  ASSERT_TRUE((*keeper)->WaitLost(absl::Seconds(10)));
  EXPECT_STATUS((*keeper)->status(), absl::StatusCode::kUnavailable);
  EXPECT_THAT((*keeper)->status().message(), HasSubstr("not renewed within its TTL"));
  ASSERT_OK(etcd_->Continue(0));
  // The keeper was right to give up: etcd expires the lease once it runs again.
  EXPECT_TRUE(Eventually([&] { return !Exists("owned"); }));
}

TEST_F(EtcdClientTest, TxnDeletesAKeyRangeAndNothingOutsideIt) {
  for (const char* key : {"r/1", "r/2", "r/3", "r/4", "s/1"}) ASSERT_OK(client_->Put(key, "v"));
  const absl::StatusOr<TxnResult> deleted =
      client_->Txn(TxnRequest{.on_success = {Operation::DeleteRange("r/2", "r/4")}});
  ASSERT_OK(deleted);
  ASSERT_EQ(deleted->results.size(), 1u);
  EXPECT_EQ(deleted->results[0].deleted, 2);
  for (const char* key : {"r/1", "r/4", "s/1"}) EXPECT_TRUE(Exists(key)) << key;
  for (const char* key : {"r/2", "r/3"}) EXPECT_FALSE(Exists(key)) << key;
}

TEST_F(EtcdClientTest, WatchDeliversPrefixEventsInOrderFromARevision) {
  const absl::StatusOr<int64_t> start = client_->Put("w/1", "a");
  ASSERT_OK(start);
  ASSERT_OK(client_->Put("w/2", "b"));
  const absl::StatusOr<TxnResult> both = client_->Txn(
      TxnRequest{.on_success = {Operation::Put("w/3", "c"), Operation::Put("w/4", "d")}});
  ASSERT_OK(both);
  ASSERT_OK(client_->Put("elsewhere", "x"));
  const absl::StatusOr<DeleteResult> deleted = client_->Delete("w/1");
  ASSERT_OK(deleted);

  absl::StatusOr<std::unique_ptr<Watcher>> watcher = client_->WatchPrefix("w/", *start);
  ASSERT_OK(watcher);
  std::vector<std::string> seen;
  std::vector<int64_t> revisions;
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<WatchEvent> event = (*watcher)->Next(absl::Seconds(10));
    ASSERT_OK(event);
    seen.push_back((event->type == WatchEvent::Type::kPut ? "put " : "delete ") + event->kv.key);
    revisions.push_back(event->kv.mod_revision);
  }
  EXPECT_THAT(seen, ElementsAre("put w/1", "put w/2", "put w/3", "put w/4", "delete w/1"));
  EXPECT_EQ(revisions[0], *start);
  EXPECT_EQ(revisions[2], both->revision);
  EXPECT_EQ(revisions[3], both->revision);
  EXPECT_EQ(revisions[4], deleted->revision);
  EXPECT_EQ((*watcher)->next_revision(), deleted->revision + 1);

  // Nothing else under the prefix yet; then a live write arrives.
  EXPECT_STATUS((*watcher)->Next(absl::Milliseconds(100)), absl::StatusCode::kDeadlineExceeded);
  const absl::StatusOr<int64_t> live = client_->Put("w/5", "e");
  ASSERT_OK(live);
  absl::StatusOr<WatchEvent> event = (*watcher)->Next(absl::Seconds(10));
  ASSERT_OK(event);
  EXPECT_EQ(event->kv.key, "w/5");
  EXPECT_EQ(event->kv.value, "e");
  EXPECT_EQ(event->kv.mod_revision, *live);
  EXPECT_EQ((*watcher)->resumes(), 0);
}

TEST_F(EtcdClientTest, CompactionDiscardsHistoryAndWatchersSayWhenTheyNeededIt) {
  const absl::StatusOr<int64_t> first = client_->Put("k", "v1");
  ASSERT_OK(first);
  ASSERT_OK(client_->Put("k", "v2"));
  const absl::StatusOr<int64_t> last = client_->Put("k", "v3");
  ASSERT_OK(last);

  const absl::StatusOr<RangeResult> before = client_->GetPrefix("k", {.revision = *first});
  ASSERT_OK(before);
  ASSERT_EQ(before->kvs.size(), 1u);
  EXPECT_EQ(before->kvs[0].value, "v1");

  ASSERT_OK(client_->Compact(*last));
  EXPECT_OK(client_->Compact(*first));  // already covered: not an error
  EXPECT_STATUS(client_->GetPrefix("k", {.revision = *first}), absl::StatusCode::kOutOfRange);
  const absl::StatusOr<RangeResult> at_last = client_->GetPrefix("k", {.revision = *last});
  ASSERT_OK(at_last);
  EXPECT_EQ(at_last->kvs[0].value, "v3");

  absl::StatusOr<std::unique_ptr<Watcher>> watcher = client_->WatchKey("k", *first);
  ASSERT_OK(watcher);
  const absl::StatusOr<WatchEvent> event = (*watcher)->Next(absl::Seconds(10));
  ASSERT_STATUS(event, absl::StatusCode::kOutOfRange);
  EXPECT_THAT(event.status().message(), HasSubstr("compacted"));
  EXPECT_THAT(event.status().message(), HasSubstr(std::to_string(*last)));
  // A watch from the compaction point on works.
  absl::StatusOr<std::unique_ptr<Watcher>> from_last = client_->WatchKey("k", *last);
  ASSERT_OK(from_last);
  const absl::StatusOr<WatchEvent> current = (*from_last)->Next(absl::Seconds(10));
  ASSERT_OK(current);
  EXPECT_EQ(current->kv.value, "v3");
}

TEST_F(EtcdClientTest, CallsToAStoppedMemberTimeOutNamingTheEndpointAndTheCall) {
  Options options = etcd_->ClientOptions();
  options.call_timeout = absl::Milliseconds(600);
  options.attempt_timeout = absl::Milliseconds(300);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  ASSERT_OK(client);
  ASSERT_OK((*client)->Put("k", "v"));  // connected

  ASSERT_OK(etcd_->Stop(0));
  const absl::Time start = absl::Now();
  const absl::StatusOr<std::optional<KeyValue>> read = (*client)->Get("k");
  ASSERT_STATUS(read, absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(read.status().message(), HasSubstr("Get of 'k'"));
  EXPECT_THAT(read.status().message(), HasSubstr(etcd_->endpoint(0)));
  const absl::StatusOr<int64_t> write = (*client)->Put("k", "w");
  ASSERT_STATUS(write, absl::StatusCode::kUnavailable);
  EXPECT_THAT(write.status().message(), HasSubstr("outcome unknown"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_OK(etcd_->Continue(0));
  EXPECT_TRUE(Eventually([&] { return (*client)->Get("k").ok(); }));
}

TEST(EtcdTlsTest, MutualTlsServesOnlyClientsWithACertificateFromItsCa) {
  char directory_template[] = "/tmp/moesnap-certs-XXXXXX";
  const std::string directory = mkdtemp(directory_template);
  const absl::StatusOr<moesnap::testing::TestCertificates> certificates =
      moesnap::testing::MakeTestCertificates(directory);
  ASSERT_OK(certificates);
  absl::StatusOr<std::unique_ptr<EtcdCluster>> etcd =
      EtcdCluster::Start({.server_cert_file = certificates->server_cert_file,
                          .server_key_file = certificates->server_key_file,
                          .client_ca_file = certificates->ca_file,
                          .client_tls = {.ca_file = certificates->ca_file,
                                         .cert_file = certificates->client_cert_file,
                                         .key_file = certificates->client_key_file}});
  ASSERT_OK(etcd);

  absl::StatusOr<std::unique_ptr<Client>> mutual = Client::Create((*etcd)->ClientOptions());
  ASSERT_OK(mutual);
  ASSERT_OK((*mutual)->Put("k", "v"));
  const absl::StatusOr<std::optional<KeyValue>> read = (*mutual)->Get("k");
  ASSERT_OK(read);
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ((*read)->value, "v");

  // Without a client certificate, and without TLS at all, the member serves nothing.
  Options no_certificate = (*etcd)->ClientOptions();
  no_certificate.call_timeout = absl::Seconds(1);
  no_certificate.tls = {.ca_file = certificates->ca_file};
  Options plaintext = no_certificate;
  plaintext.tls = {};
  for (const Options& options : {no_certificate, plaintext}) {
    absl::StatusOr<std::unique_ptr<Client>> refused = Client::Create(options);
    ASSERT_OK(refused);
    const absl::StatusOr<std::optional<KeyValue>> attempt = (*refused)->Get("k");
    EXPECT_FALSE(attempt.ok());
    EXPECT_THAT(attempt.status().message(), HasSubstr((*etcd)->endpoint(0)));
  }
  etcd->reset();
  std::filesystem::remove_all(directory);
}

}  // namespace
}  // namespace moesnap::etcd
