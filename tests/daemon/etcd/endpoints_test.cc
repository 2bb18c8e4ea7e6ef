// The etcd client's failover and retry rule, against in-process fake members (gRPC servers of
// etcd's KV service on loopback) whose answers each test scripts: which failures move a call to the
// next endpoint, which writes must not be resent, and how WriteOnce recovers a write whose answer
// was lost.
#include "daemon/etcd/endpoints.h"

#include <grpcpp/grpcpp.h>

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/loopback_port.h"
#include "common/metrics.h"
#include "daemon/etcd/etcd_client.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::etcd {
namespace {

using ::testing::HasSubstr;

// The keys both fake members serve, as one etcd cluster would.
struct FakeStore {
  absl::Mutex mutex;
  std::map<std::string, mvccpb::KeyValue> kvs ABSL_GUARDED_BY(mutex);
  int64_t revision ABSL_GUARDED_BY(mutex) = 1;
};

// What a fake member does with its next call.
enum class Fate {
  kServe,              // answer as etcd would
  kRefuse,             // fail before applying anything
  kApplyThenFail,      // apply, then fail instead of answering (the answer is lost)
  kHangUntilDeadline,  // answer nothing until the caller gives up
};

class FakeMember final : public etcdserverpb::KV::Service {
 public:
  explicit FakeMember(FakeStore* store) : store_(store) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~FakeMember() override { server_->Shutdown(absl::ToChronoTime(absl::Now())); }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  // The next call meets `fate`, failing (where it fails) with `status`.
  void Script(Fate fate, grpc::Status status = grpc::Status::OK) {
    absl::MutexLock lock(&mutex_);
    script_.push_back({fate, std::move(status)});
  }
  int calls() const {
    absl::MutexLock lock(&mutex_);
    return calls_;
  }

  grpc::Status Range(grpc::ServerContext* context, const etcdserverpb::RangeRequest* request,
                     etcdserverpb::RangeResponse* response) override {
    return Handle(context, [&] {
      absl::MutexLock lock(&store_->mutex);
      if (auto found = store_->kvs.find(request->key()); found != store_->kvs.end()) {
        *response->add_kvs() = found->second;
      }
      response->mutable_header()->set_revision(store_->revision);
    });
  }

  grpc::Status Put(grpc::ServerContext* context, const etcdserverpb::PutRequest* request,
                   etcdserverpb::PutResponse* response) override {
    return Handle(context, [&] {
      absl::MutexLock lock(&store_->mutex);
      response->mutable_header()->set_revision(Write(request->key(), request->value()));
    });
  }

  // Enough of etcd's Txn for WriteOnce: compares on create revision, puts and gets.
  grpc::Status Txn(grpc::ServerContext* context, const etcdserverpb::TxnRequest* request,
                   etcdserverpb::TxnResponse* response) override {
    return Handle(context, [&] {
      absl::MutexLock lock(&store_->mutex);
      bool holds = true;
      for (const etcdserverpb::Compare& compare : request->compare()) {
        auto found = store_->kvs.find(compare.key());
        const int64_t created = found == store_->kvs.end() ? 0 : found->second.create_revision();
        holds = holds && compare.target() == etcdserverpb::Compare::CREATE &&
                compare.result() == etcdserverpb::Compare::EQUAL &&
                created == compare.create_revision();
      }
      response->set_succeeded(holds);
      for (const etcdserverpb::RequestOp& op : holds ? request->success() : request->failure()) {
        etcdserverpb::ResponseOp* answer = response->add_responses();
        if (op.has_request_put()) {
          Write(op.request_put().key(), op.request_put().value());
          answer->mutable_response_put();
        } else if (op.has_request_range()) {
          auto found = store_->kvs.find(op.request_range().key());
          etcdserverpb::RangeResponse* range = answer->mutable_response_range();
          if (found != store_->kvs.end()) *range->add_kvs() = found->second;
        }
      }
      response->mutable_header()->set_revision(store_->revision);
    });
  }

 private:
  int64_t Write(const std::string& key, const std::string& value)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_->mutex) {
    const int64_t revision = ++store_->revision;
    mvccpb::KeyValue& kv = store_->kvs[key];
    if (kv.create_revision() == 0) kv.set_create_revision(revision);
    kv.set_key(key);
    kv.set_value(value);
    kv.set_mod_revision(revision);
    kv.set_version(kv.version() + 1);
    return revision;
  }

  template <typename Apply>
  grpc::Status Handle(grpc::ServerContext* context, Apply apply) {
    std::pair<Fate, grpc::Status> next{Fate::kServe, grpc::Status::OK};
    {
      absl::MutexLock lock(&mutex_);
      ++calls_;
      if (!script_.empty()) {
        next = script_.front();
        script_.pop_front();
      }
    }
    switch (next.first) {
      case Fate::kServe:
        apply();
        return grpc::Status::OK;
      case Fate::kRefuse:
        return next.second;
      case Fate::kApplyThenFail:
        apply();
        return next.second;
      case Fate::kHangUntilDeadline:
        while (!context->IsCancelled()) absl::SleepFor(absl::Milliseconds(5));
        return grpc::Status(grpc::StatusCode::CANCELLED, "caller gave up");
    }
    return grpc::Status::OK;
  }

  FakeStore* const store_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  mutable absl::Mutex mutex_;
  std::deque<std::pair<Fate, grpc::Status>> script_ ABSL_GUARDED_BY(mutex_);
  int calls_ ABSL_GUARDED_BY(mutex_) = 0;
};

const grpc::Status kTimedOut(grpc::StatusCode::UNAVAILABLE, "etcdserver: request timed out");
const grpc::Status kNoLeader(grpc::StatusCode::UNAVAILABLE, "etcdserver: no leader");

class EndpointsTest : public ::testing::Test {
 protected:
  EndpointsTest() : first_(&store_), second_(&store_) {}

  std::unique_ptr<Client> NewClient(absl::Duration call_timeout = absl::Seconds(5)) {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Create(Options{.endpoints = {first_.address(), second_.address()},
                               .call_timeout = call_timeout,
                               .attempt_timeout = absl::Seconds(1),
                               .dial_timeout = absl::Seconds(1)});
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  // A client whose first endpoint is a closed port (a member whose process is gone) and whose
  // second is the first member; its dial timeout (30 s) is longer than a call's deadline (3 s).
  absl::StatusOr<std::unique_ptr<Client>> ClientTryingAClosedPortFirst() {
    return Client::Create(
        Options{.endpoints = {absl::StrCat("127.0.0.1:", UnusedLoopbackPort()), first_.address()},
                .call_timeout = absl::Seconds(3),
                .attempt_timeout = absl::Seconds(1),
                .dial_timeout = absl::Seconds(30)});
  }

  FakeStore store_;
  FakeMember first_;
  FakeMember second_;
};

TEST_F(EndpointsTest, ReadMovesToTheNextEndpointAfterAFailureAndStaysThere) {
  std::unique_ptr<Client> client = NewClient();
  ASSERT_NE(client, nullptr);
  first_.Script(Fate::kRefuse, kTimedOut);
  const absl::StatusOr<std::optional<KeyValue>> read = client->Get("k");
  ASSERT_OK(read);
  EXPECT_EQ(first_.calls(), 1);
  EXPECT_EQ(second_.calls(), 1);
  // The next call starts where the last one succeeded.
  const absl::StatusOr<std::optional<KeyValue>> again = client->Get("k");
  ASSERT_OK(again);
  EXPECT_EQ(first_.calls(), 1);
  EXPECT_EQ(second_.calls(), 2);
}

// The value of one series in the process's /metrics exposition (-1 when absent).
double Sample(const std::string& series) {
  const std::string text = metrics::Registry::Default().Exposition();
  const size_t at = text.find("\n" + series + " ");
  double value = -1;
  if (at != std::string::npos) {
    const size_t start = at + series.size() + 2;
    EXPECT_TRUE(absl::SimpleAtod(text.substr(start, text.find('\n', start) - start), &value));
  }
  return value;
}

TEST_F(EndpointsTest, ConnectivityMetricsFollowEveryAttempt) {
  std::unique_ptr<Client> client = NewClient();
  ASSERT_NE(client, nullptr);
  const double answered = Sample("moesnap_etcd_attempts_total{outcome=\"answered\"}");
  const double unanswered = Sample("moesnap_etcd_attempts_total{outcome=\"unanswered\"}");
  const double failovers = Sample("moesnap_etcd_failovers_total");
  ASSERT_GE(answered, 0);
  first_.Script(Fate::kRefuse, kTimedOut);
  ASSERT_OK(client->Get("k"));  // refused by the first member, answered by the second
  EXPECT_EQ(Sample("moesnap_etcd_attempts_total{outcome=\"unanswered\"}"), unanswered + 1);
  EXPECT_EQ(Sample("moesnap_etcd_attempts_total{outcome=\"answered\"}"), answered + 1);
  EXPECT_EQ(Sample("moesnap_etcd_failovers_total"), failovers + 1);
  EXPECT_EQ(Sample("moesnap_etcd_reachable"), 1);
  // A member nobody listens for: no connection, so no answer.
  absl::StatusOr<std::unique_ptr<Client>> lost =
      Client::Create(Options{.endpoints = {absl::StrCat("127.0.0.1:", UnusedLoopbackPort())},
                             .call_timeout = absl::Milliseconds(300),
                             .attempt_timeout = absl::Milliseconds(100),
                             .dial_timeout = absl::Milliseconds(100)});
  ASSERT_OK(lost);
  EXPECT_FALSE((*lost)->Get("k").ok());
  EXPECT_EQ(Sample("moesnap_etcd_reachable"), 0);
  EXPECT_GT(Sample("moesnap_etcd_attempts_total{outcome=\"unanswered\"}"), unanswered + 1);
}

// A failover is an answer from another endpoint than the last answer's: a call that finds no
// member, polling every endpoint round after round, counts unanswered attempts but no failover;
// the answer that ends the outage counts one, and later answers from the same member none.
TEST_F(EndpointsTest, FailoversCountAnswersThatMovedNotRoundsWithoutAnswer) {
  const double failovers = Sample("moesnap_etcd_failovers_total");
  const double unanswered = Sample("moesnap_etcd_attempts_total{outcome=\"unanswered\"}");
  ASSERT_GE(failovers, 0);
  absl::StatusOr<std::unique_ptr<Client>> none =
      Client::Create(Options{.endpoints = {absl::StrCat("127.0.0.1:", UnusedLoopbackPort()),
                                           absl::StrCat("127.0.0.1:", UnusedLoopbackPort())},
                             .call_timeout = absl::Milliseconds(400),
                             .attempt_timeout = absl::Milliseconds(100),
                             .dial_timeout = absl::Milliseconds(100)});
  ASSERT_OK(none);
  EXPECT_FALSE((*none)->Get("k").ok());
  // Two endpoints a round, a round at least every 50 ms once connections are refused.
  EXPECT_GE(Sample("moesnap_etcd_attempts_total{outcome=\"unanswered\"}"), unanswered + 4);
  EXPECT_EQ(Sample("moesnap_etcd_failovers_total"), failovers);

  absl::StatusOr<std::unique_ptr<Client>> client = ClientTryingAClosedPortFirst();
  ASSERT_OK(client);
  ASSERT_OK((*client)->Get("k"));
  EXPECT_EQ(Sample("moesnap_etcd_failovers_total"), failovers + 1);
  ASSERT_OK((*client)->Get("k"));
  EXPECT_EQ(Sample("moesnap_etcd_failovers_total"), failovers + 1);
}

// A member that refuses connections (its process gone, its port closed) is left for the next one
// at once: the attempt does not wait out the dial timeout, which here is longer than the call's
// whole deadline (a lease keep-alive's attempt is a share of the lease's TTL).
TEST_F(EndpointsTest, AMemberRefusingConnectionsIsLeftForTheNextAtOnce) {
  absl::StatusOr<std::unique_ptr<Client>> client = ClientTryingAClosedPortFirst();
  ASSERT_OK(client);
  ASSERT_OK((*client)->Get("k"));
  EXPECT_EQ(first_.calls(), 1);
}

TEST_F(EndpointsTest, WriteWithAnUnknownOutcomeIsNotResent) {
  std::unique_ptr<Client> client = NewClient();
  ASSERT_NE(client, nullptr);
  first_.Script(Fate::kApplyThenFail, kTimedOut);
  const absl::StatusOr<int64_t> put = client->Put("k", "v");
  ASSERT_STATUS(put, absl::StatusCode::kUnavailable);
  EXPECT_THAT(put.status().message(), HasSubstr("outcome unknown"));
  EXPECT_THAT(put.status().message(), HasSubstr(first_.address()));
  EXPECT_THAT(put.status().message(), HasSubstr("Put of 'k'"));
  EXPECT_EQ(second_.calls(), 0);
  // Resending would have written the key twice.
  const absl::StatusOr<std::optional<KeyValue>> read = client->Get("k");
  ASSERT_OK(read);
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ((*read)->version, 1);
}

TEST_F(EndpointsTest, WriteRefusedForWantOfALeaderGoesToTheNextEndpoint) {
  std::unique_ptr<Client> client = NewClient();
  ASSERT_NE(client, nullptr);
  first_.Script(Fate::kRefuse, kNoLeader);
  const absl::StatusOr<int64_t> put = client->Put("k", "v");
  ASSERT_OK(put);
  EXPECT_EQ(first_.calls(), 1);
  EXPECT_EQ(second_.calls(), 1);
}

TEST_F(EndpointsTest, DefiniteErrorIsNotRetriedAndNamesTheEndpoint) {
  std::unique_ptr<Client> client = NewClient();
  ASSERT_NE(client, nullptr);
  first_.Script(Fate::kRefuse, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                            "etcdserver: key is not provided"));
  const absl::StatusOr<std::optional<KeyValue>> read = client->Get("k");
  ASSERT_STATUS(read, absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(read.status().message(), HasSubstr(first_.address()));
  EXPECT_THAT(read.status().message(), HasSubstr("etcdserver: key is not provided"));
  EXPECT_EQ(second_.calls(), 0);
}

TEST_F(EndpointsTest, WriteOnceWhoseAnswerWasLostFindsItsOwnWrite) {
  std::unique_ptr<Client> client = NewClient();
  ASSERT_NE(client, nullptr);
  first_.Script(Fate::kApplyThenFail, kTimedOut);
  const absl::StatusOr<KeyValue> stored = client->WriteOnce("decision/1", "commit");
  ASSERT_OK(stored);
  EXPECT_EQ(stored->value, "commit");
  EXPECT_EQ(stored->version, 1);  // written once, not twice
  EXPECT_EQ(first_.calls(), 1);
  EXPECT_EQ(second_.calls(), 1);
}

TEST_F(EndpointsTest, CallTimesOutNamingEveryEndpointTried) {
  std::unique_ptr<Client> client = NewClient(absl::Milliseconds(1500));
  ASSERT_NE(client, nullptr);
  for (int i = 0; i < 10; ++i) {
    first_.Script(Fate::kHangUntilDeadline);
    second_.Script(Fate::kHangUntilDeadline);
  }
  const absl::Time start = absl::Now();
  const absl::StatusOr<std::optional<KeyValue>> read = client->Get("k");
  ASSERT_STATUS(read, absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_THAT(read.status().message(), HasSubstr("Get of 'k'"));
  EXPECT_THAT(read.status().message(), HasSubstr(first_.address()));
  EXPECT_THAT(read.status().message(), HasSubstr(second_.address()));
}

TEST(ClassifyFailureTest, SaysWhichFailuresMayHaveBeenApplied) {
  using internal::ClassifyFailure;
  using internal::Failure;
  EXPECT_EQ(ClassifyFailure(kNoLeader), Failure::kNotApplied);
  EXPECT_EQ(ClassifyFailure(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                         "failed to connect to all addresses; last error: ...")),
            Failure::kNotApplied);
  EXPECT_EQ(ClassifyFailure(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                         "etcdserver: too many requests")),
            Failure::kNotApplied);
  EXPECT_EQ(ClassifyFailure(kTimedOut), Failure::kOutcomeUnknown);
  EXPECT_EQ(ClassifyFailure(grpc::Status(grpc::StatusCode::UNAVAILABLE, "Socket closed")),
            Failure::kOutcomeUnknown);
  EXPECT_EQ(ClassifyFailure(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded")),
            Failure::kOutcomeUnknown);
  EXPECT_EQ(ClassifyFailure(grpc::Status(grpc::StatusCode::OUT_OF_RANGE,
                                         "etcdserver: mvcc: required revision has been compacted")),
            Failure::kDefinite);
  EXPECT_EQ(ClassifyFailure(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                         "etcdserver: mvcc: database space exceeded")),
            Failure::kDefinite);
  EXPECT_EQ(ClassifyFailure(
                grpc::Status(grpc::StatusCode::NOT_FOUND, "etcdserver: requested lease not found")),
            Failure::kDefinite);
}

TEST(PrefixRangeEndTest, IncrementsTheLastByteThatCanBe) {
  EXPECT_EQ(PrefixRangeEnd("job/a/"), "job/a0");
  EXPECT_EQ(PrefixRangeEnd("a"), "b");
  EXPECT_EQ(PrefixRangeEnd(std::string("a\xff", 2)), "b");
  EXPECT_EQ(PrefixRangeEnd(std::string("a\xfe\xff", 3)), std::string("a\xff", 2));
  EXPECT_EQ(PrefixRangeEnd(std::string("\xff\xff", 2)), std::string(1, '\0'));
  EXPECT_EQ(PrefixRangeEnd(""), std::string(1, '\0'));
}

TEST(OptionsTest, BadOptionsAreRefusedNamingTheProblem) {
  const auto refused = [](const Options& options) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
    EXPECT_STATUS(client, absl::StatusCode::kInvalidArgument);
    return std::string(client.status().message());
  };
  EXPECT_THAT(refused(Options{}), HasSubstr("at least one endpoint"));
  EXPECT_THAT(refused(Options{.endpoints = {"127.0.0.1"}}),
              HasSubstr("'127.0.0.1' is not host:port"));
  EXPECT_THAT(refused(Options{.endpoints = {"127.0.0.1:99999"}}), HasSubstr("not host:port"));
  EXPECT_THAT(
      refused(Options{.endpoints = {"127.0.0.1:2379"}, .call_timeout = absl::ZeroDuration()}),
      HasSubstr("call_timeout must be positive"));
  EXPECT_THAT(
      refused(Options{.endpoints = {"127.0.0.1:2379"}, .tls = {.ca_file = "/nonexistent/ca.pem"}}),
      HasSubstr("'/nonexistent/ca.pem'"));
  EXPECT_THAT(refused(Options{.endpoints = {"127.0.0.1:2379"},
                              .tls = {.ca_file = "/dev/null", .cert_file = "/dev/null"}}),
              HasSubstr("both tls.cert_file and tls.key_file"));
  EXPECT_THAT(refused(Options{.endpoints = {"127.0.0.1:2379"}, .tls = {.ca_file = "/dev/null"}}),
              HasSubstr("no PEM block"));
}

}  // namespace
}  // namespace moesnap::etcd
