// The threads trainers' calls hold in a real moesnapd are bounded: a rank that parks calls (waits
// for a step that never commits) is refused beyond its bound while other ranks are served, calls
// beyond the agent server's thread cap are refused rather than queued, and the daemon serves again
// as the parked calls end.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/memory_handoff_wire.h"
#include "moesnap/client.h"
#include "proto/moesnap.grpc.pb.h"
#include "tests/testing/http_client.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::TestDaemon;
using testing::TestDaemonOptions;
using namespace std::chrono_literals;

// What one rank may have in flight (AgentService::kCallsPerRank).
constexpr int kCallsPerRank = 16;
// How long a test waits for a condition before it fails.
constexpr auto kPatience = 30s;

// Asynchronous WaitCommitted calls of one session for a step that never commits: each stays in
// the daemon, holding a thread, until it is cancelled (or refused on its way in).
class ParkedCalls {
 public:
  ParkedCalls(v1::Agent::Stub* agent, std::string session, uint32_t rank, int64_t step)
      : agent_(agent), session_(std::move(session)), rank_(rank), step_(step) {}
  ~ParkedCalls() {
    CancelAll();
    queue_.Shutdown();
    void* tag;
    bool ok;
    while (queue_.Next(&tag, &ok)) {
    }
  }

  void Add() {
    auto call = std::make_unique<Call>();
    call->context.AddMetadata(memory_handoff::kSessionMetadataKey, session_);
    call->context.set_deadline(std::chrono::system_clock::now() + 10min);
    v1::WaitRequest request;
    request.set_rank(rank_);
    request.set_step(step_);
    call->reader = agent_->AsyncWaitCommitted(&call->context, request, &queue_);
    call->reader->Finish(&call->response, &call->status, call.get());
    pending_.push_back(std::move(call));
  }

  // The statuses of the calls that ended within `wait` (none may).
  std::vector<grpc::Status> Ended(std::chrono::milliseconds wait) {
    std::vector<grpc::Status> ended;
    auto deadline = std::chrono::system_clock::now() + wait;
    void* tag;
    bool ok;
    while (queue_.AsyncNext(&tag, &ok, deadline) == grpc::CompletionQueue::GOT_EVENT) {
      for (auto it = pending_.begin(); it != pending_.end(); ++it) {
        if (it->get() != tag) continue;
        ended.push_back((*it)->status);
        pending_.erase(it);
        break;
      }
      deadline = std::chrono::system_clock::now();  // take what ended already, wait no more
    }
    return ended;
  }

  // Cancels every call and waits until each has ended.
  void CancelAll() {
    for (const auto& call : pending_) call->context.TryCancel();
    while (!pending_.empty()) Ended(1s);
  }

  size_t pending() const { return pending_.size(); }

 private:
  struct Call {
    grpc::ClientContext context;
    v1::WaitResponse response;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<v1::WaitResponse>> reader;
  };

  v1::Agent::Stub* agent_;
  const std::string session_;
  const uint32_t rank_;
  const int64_t step_;
  grpc::CompletionQueue queue_;
  std::vector<std::unique_ptr<Call>> pending_;
};

class TrainerCallBoundsTest : public ::testing::Test {
 protected:
  // A daemon with `agent_max_threads` (0: its default), and rank 0's step 1 captured and waiting
  // forever to commit: rank 0 declared a replica group with rank 9, which never takes the step.
  // The test then acts for rank 0 itself, with a session of its own (session_).
  void Start(int agent_max_threads) {
    daemon_ = std::make_unique<TestDaemon>(
        TestDaemonOptions{.pool_bytes = "64MiB", .agent_max_threads = agent_max_threads});
    ASSERT_TRUE(daemon_->Start());
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.socket_path = daemon_->agent_socket(), .rank = 0});
    ASSERT_OK(client);
    stuck_trainer_ = *std::move(client);
    absl::StatusOr<std::shared_ptr<SharedBuffer>> memory = stuck_trainer_->AllocateHost(64 << 10);
    ASSERT_OK(memory);
    stuck_memory_ = *memory;
    ASSERT_OK(stuck_trainer_->RegisterHostRegion({"weights", "uint8", {64 << 10}}, stuck_memory_, 0,
                                                 64 << 10));
    ASSERT_OK(stuck_trainer_->SetReplicaGroup({"data-parallel", {0, 9}}));
    ASSERT_OK(stuck_trainer_->Snapshot(1));
    ASSERT_OK(stuck_trainer_->WaitCaptured(1));

    agent_ = v1::Agent::NewStub(
        grpc::CreateChannel("unix:" + daemon_->agent_socket(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    v1::HelloRequest hello;
    hello.set_rank(0);  // the same user: takes rank 0 over from stuck_trainer_
    v1::HelloResponse response;
    const grpc::Status said = agent_->Hello(&context, hello, &response);
    ASSERT_TRUE(said.ok()) << said.error_message();
    session_ = response.session();
    parked_ = std::make_unique<ParkedCalls>(agent_.get(), session_, 0, 1);
  }

  // A call of rank 0 that returns at once when the daemon admits it: step 1 is captured.
  grpc::Status Probe() {
    grpc::ClientContext context;
    context.AddMetadata(memory_handoff::kSessionMetadataKey, session_);
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    v1::WaitRequest request;
    request.set_rank(0);
    request.set_step(1);
    v1::WaitResponse response;
    return agent_->WaitCaptured(&context, request, &response);
  }

  // Parks `count` calls and waits until probes are refused with RESOURCE_EXHAUSTED: then every
  // parked call holds its place (only they and the probe, one at a time, call). Twice in a row, a
  // moment apart, with no parked call refused meanwhile: a server thread that just answered a call
  // may hold its place a moment longer than the call. A parked call refused on its way in (a probe
  // held the place it needed) is parked again. Returns the last probe's answer.
  grpc::Status ParkUntilRefused(int count) {
    for (int i = 0; i < count; ++i) parked_->Add();
    const auto deadline = std::chrono::steady_clock::now() + kPatience;
    grpc::Status probed;
    int refusals = 0;
    while (refusals < 2 && std::chrono::steady_clock::now() < deadline) {
      probed = Probe();
      if (probed.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        ++refusals;
      } else {
        EXPECT_TRUE(probed.ok()) << probed.error_message();
        refusals = 0;
      }
      for (const grpc::Status& ended : parked_->Ended(10ms)) {
        EXPECT_EQ(ended.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
            << ended.error_message();
        parked_->Add();
        refusals = 0;
      }
    }
    return probed;
  }

  // Cancels the parked calls and waits until rank 0's calls are served again (the daemon sees a
  // cancelled wait within its poll interval).
  void CancelAndWaitServed() {
    parked_->CancelAll();
    const auto deadline = std::chrono::steady_clock::now() + kPatience;
    grpc::Status probed = Probe();
    while (!probed.ok() && std::chrono::steady_clock::now() < deadline) {
      EXPECT_EQ(probed.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << probed.error_message();
      parked_->Ended(10ms);  // none is left: a pause between probes
      probed = Probe();
    }
    EXPECT_TRUE(probed.ok()) << probed.error_message();
  }

  // Another rank's trainer, start to end: it connects, registers, and commits a step.
  void TrainRank(uint32_t rank) {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.socket_path = daemon_->agent_socket(), .rank = rank});
    ASSERT_OK(client);
    absl::StatusOr<std::shared_ptr<SharedBuffer>> memory = (*client)->AllocateHost(4096);
    ASSERT_OK(memory);
    ASSERT_OK((*client)->RegisterHostRegion({"weights", "uint8", {4096}}, *memory, 0, 4096));
    ASSERT_OK((*client)->Snapshot(1));
    ASSERT_OK((*client)->WaitCommitted(1));
  }

  uint64_t RefusedTotal() {
    absl::StatusOr<testing::HttpReply> scraped = testing::HttpGet(daemon_->http_port(), "/metrics");
    EXPECT_OK(scraped);
    if (!scraped.ok()) return 0;
    for (absl::string_view line : absl::StrSplit(scraped->body, '\n')) {
      uint64_t value = 0;
      if (absl::ConsumePrefix(&line, "moesnap_trainer_calls_refused_total ") &&
          absl::SimpleAtoi(line, &value)) {
        return value;
      }
    }
    ADD_FAILURE() << "no moesnap_trainer_calls_refused_total in\n" << scraped->body;
    return 0;
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> stuck_trainer_;
  std::shared_ptr<SharedBuffer> stuck_memory_;
  std::unique_ptr<v1::Agent::Stub> agent_;
  std::string session_;                  // rank 0's
  std::unique_ptr<ParkedCalls> parked_;  // destroyed first: its calls go before the daemon
};

TEST_F(TrainerCallBoundsTest, ARankBeyondItsBoundIsRefusedWhileOtherRanksAreServed) {
  ASSERT_NO_FATAL_FAILURE(Start(0));
  const uint64_t refused_before = RefusedTotal();
  const grpc::Status refused = ParkUntilRefused(kCallsPerRank);
  ASSERT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "rank 0 parked " << kCallsPerRank
      << " calls and its next one was still admitted: " << refused.error_message();
  EXPECT_TRUE(absl::StrContains(
      refused.error_message(),
      absl::StrCat("rank 0 has ", kCallsPerRank, " calls in flight, the most one caller may have")))
      << refused.error_message();
  // Another wait of the rank too, at once, not parked.
  ParkedCalls one_more(agent_.get(), session_, 0, 1);
  one_more.Add();
  std::vector<grpc::Status> ended = one_more.Ended(10s);
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << ended[0].error_message();
  EXPECT_GE(RefusedTotal(), refused_before + 3);  // two probes and that wait
  EXPECT_EQ(parked_->pending(), static_cast<size_t>(kCallsPerRank));

  // Rank 0's parked calls hold none of another rank's places.
  ASSERT_NO_FATAL_FAILURE(TrainRank(1));

  CancelAndWaitServed();
}

TEST_F(TrainerCallBoundsTest, CallsBeyondTheThreadCapAreRefusedAndServedOnceThreadsFree) {
  // Four threads: gRPC's poller and three calls.
  ASSERT_NO_FATAL_FAILURE(Start(4));
  const grpc::Status refused = ParkUntilRefused(3);
  ASSERT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "three calls parked on a server of four threads and the next was still served: "
      << refused.error_message();
  // Refused by the server's thread cap, not by the rank's bound.
  EXPECT_FALSE(absl::StrContains(refused.error_message(), "calls in flight"))
      << refused.error_message();
  // Every caller is refused while the threads are taken, a new trainer's Hello too.
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    v1::HelloRequest hello;
    hello.set_rank(2);
    v1::HelloResponse response;
    const grpc::Status said = agent_->Hello(&context, hello, &response);
    EXPECT_EQ(said.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << said.error_message();
  }
  EXPECT_EQ(parked_->pending(), 3u);

  CancelAndWaitServed();
  ASSERT_NO_FATAL_FAILURE(TrainRank(1));
}

}  // namespace
}  // namespace moesnap
