// A commit round's calls to many peers over gRPC: every call starts at once from the calling
// thread, and each answer is handed to that thread as it comes, the first to come first; a node
// no daemon holds answers at once, and a call that cannot reach its node fails naming the call
// and the node. PeerClient's own rounds (each call on a thread of its own, for clients that only
// make calls one at a time) keep the same contract.
#include "daemon/cluster/peer_client.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/loopback_port.h"
#include "daemon/cluster/node_table.h"
#include "proto/moesnap.grpc.pb.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

constexpr absl::Duration kPatience = absl::Seconds(30);

// Answers Prepare and Encode once the test releases the request's step, naming the step in the
// answer. Nodes 1 to 3 are all served here; each node's calls carry its id as the step.
class HeldPeer final : public v1::Peer::Service {
 public:
  HeldPeer() {
    for (int64_t step : {1, 2, 3}) released_[step];
  }
  void Release(int64_t step) { released_.at(step).Notify(); }

  grpc::Status Prepare(grpc::ServerContext*, const v1::PrepareRequest* request,
                       v1::PrepareResponse* response) override {
    if (!released_.at(request->step()).WaitForNotificationWithTimeout(kPatience)) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "never released");
    }
    response->mutable_image()->set_node_id(static_cast<uint32_t>(request->step()));
    return grpc::Status::OK;
  }
  grpc::Status Encode(grpc::ServerContext*, const v1::EncodeRequest* request,
                      v1::EncodeResponse* response) override {
    if (!released_.at(request->step()).WaitForNotificationWithTimeout(kPatience)) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "never released");
    }
    if (request->step() == 2) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "refused");
    response->set_bytes_sent(static_cast<uint64_t>(request->step()));
    return grpc::Status::OK;
  }

 private:
  std::map<int64_t, absl::Notification> released_;  // filled before serving, then only read
};

// Forwards the calls a round makes to `inner` one at a time, so that its rounds are PeerClient's
// own.
class OneCallAtATime final : public PeerClient {
 public:
  explicit OneCallAtATime(PeerClient* inner) : inner_(inner) {}
  absl::StatusOr<v1::NodeReport> Describe(uint32_t node) override {
    return inner_->Describe(node);
  }
  absl::StatusOr<v1::ProposeResponse> Propose(uint32_t node,
                                              const v1::ProposeRequest& request) override {
    return inner_->Propose(node, request);
  }
  absl::StatusOr<v1::PrepareResponse> Prepare(uint32_t node,
                                              const v1::PrepareRequest& request) override {
    return inner_->Prepare(node, request);
  }
  absl::StatusOr<v1::EncodeResponse> Encode(uint32_t node,
                                            const v1::EncodeRequest& request) override {
    return inner_->Encode(node, request);
  }
  absl::StatusOr<v1::GroupStateResponse> GroupState(uint32_t node) override {
    return inner_->GroupState(node);
  }
  absl::StatusOr<v1::SendUnitsResponse> SendUnits(uint32_t node,
                                                  const v1::SendUnitsRequest& request) override {
    return inner_->SendUnits(node, request);
  }
  absl::StatusOr<v1::DecodeUnitsResponse> DecodeUnits(
      uint32_t node, const v1::DecodeUnitsRequest& request) override {
    return inner_->DecodeUnits(node, request);
  }
  absl::StatusOr<v1::RebuildResponse> Rebuild(uint32_t node) override {
    return inner_->Rebuild(node);
  }
  absl::StatusOr<v1::LocateRankResponse> LocateRank(
      uint32_t node, const v1::LocateRankRequest& request) override {
    return inner_->LocateRank(node, request);
  }
  absl::StatusOr<v1::FetchLogResponse> FetchLog(uint32_t node,
                                                const v1::FetchLogRequest& request) override {
    return inner_->FetchLog(node, request);
  }
  uint64_t calls() const override { return inner_->calls(); }
  absl::StatusOr<v1::DurableStateResponse> DurableState(uint32_t node,
                                                        absl::Time deadline) override {
    return inner_->DurableState(node, deadline);
  }

 private:
  PeerClient* const inner_;
};

class PeerClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&peer_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    for (uint32_t id : {1, 2, 3}) Set(id, static_cast<uint16_t>(port));
    // Nothing listens where node 5 is said to be.
    const uint16_t unused = UnusedLoopbackPort();
    ASSERT_NE(unused, 0);
    Set(5, unused);
    // Node 4 is held by no daemon.
    client_ = NewGrpcPeerClient(&nodes_, {.reconnect_backoff = absl::Milliseconds(100),
                                          .tls = nullptr});
  }
  void TearDown() override { server_->Shutdown(); }

  void Set(uint32_t id, uint16_t port) {
    nodes_.Set({.id = id, .live = true, .address = {id, "127.0.0.1", port, 1},
                .hostname = "test", .incarnation = 1});
  }

  // A round of Prepare to nodes 1 to 5 on `client`: the nodes' answers in the order they came,
  // each checked to come on this thread. Node 3 is released first, then node 1 once node 3's
  // answer is in, then node 2 once node 1's is.
  std::vector<std::pair<uint32_t, absl::StatusOr<v1::PrepareResponse>>> PrepareRound(
      PeerClient& client) {
    std::vector<std::pair<uint32_t, v1::PrepareRequest>> calls;
    for (uint32_t id : {1, 2, 3, 4, 5}) {
      v1::PrepareRequest request;
      request.set_step(id);
      request.set_timeout_ms(5000);
      calls.emplace_back(id, request);
    }
    const std::thread::id caller = std::this_thread::get_id();
    std::vector<std::pair<uint32_t, absl::StatusOr<v1::PrepareResponse>>> answers;
    peer_.Release(3);
    client.PrepareEach(calls, [&](uint32_t id, absl::StatusOr<v1::PrepareResponse> answer) {
      EXPECT_EQ(std::this_thread::get_id(), caller) << "node " << id;
      if (id == 3) peer_.Release(1);
      if (id == 1) peer_.Release(2);
      answers.emplace_back(id, std::move(answer));
    });
    return answers;
  }

  void ExpectRoundAnswers(
      const std::vector<std::pair<uint32_t, absl::StatusOr<v1::PrepareResponse>>>& answers,
      bool lost_first) {
    ASSERT_EQ(answers.size(), 5u);
    std::vector<uint32_t> served;
    for (const auto& [id, answer] : answers) {
      if (id == 4) {
        EXPECT_STATUS(answer.status(), absl::StatusCode::kUnavailable);
        EXPECT_TRUE(absl::StrContains(answer.status().message(), "node 4 is lost"))
            << answer.status();
      } else if (id == 5) {
        EXPECT_STATUS(answer.status(), absl::StatusCode::kUnavailable);
        EXPECT_TRUE(absl::StrContains(answer.status().message(), "Prepare to node 5"))
            << answer.status();
      } else {
        ASSERT_OK(answer.status());
        EXPECT_EQ(answer->image().node_id(), id);
        served.push_back(id);
      }
    }
    EXPECT_EQ(served, (std::vector<uint32_t>{3, 1, 2}));
    if (lost_first) {
      EXPECT_EQ(answers.front().first, 4u);
    }
  }

  HeldPeer peer_;
  std::unique_ptr<grpc::Server> server_;
  NodeTable nodes_{8};
  std::unique_ptr<PeerClient> client_;
};

TEST_F(PeerClientTest, ARoundOverGrpcHandsEachAnswerToTheCallerAsItComes) {
  ExpectRoundAnswers(PrepareRound(*client_), /*lost_first=*/true);
}

TEST_F(PeerClientTest, ARoundOfCallsMadeOneAtATimeHandsEachAnswerToTheCallerAsItComes) {
  OneCallAtATime threaded(client_.get());
  ExpectRoundAnswers(PrepareRound(threaded), /*lost_first=*/false);
}

TEST_F(PeerClientTest, AnEncodeRoundPassesThePeersOwnRefusalUnchanged) {
  for (int64_t step : {1, 2, 3}) peer_.Release(step);
  std::vector<v1::EncodeRequest> requests(3);
  std::vector<std::pair<uint32_t, const v1::EncodeRequest*>> calls;
  for (uint32_t id : {1, 2, 3}) {
    v1::EncodeRequest& request = requests[id - 1];
    request.set_step(id);
    request.set_timeout_ms(5000);
    calls.emplace_back(id, &request);
  }
  std::map<uint32_t, absl::StatusOr<v1::EncodeResponse>> answers;
  client_->EncodeEach(calls, [&](uint32_t id, absl::StatusOr<v1::EncodeResponse> answer) {
    answers.emplace(id, std::move(answer));
  });
  ASSERT_EQ(answers.size(), 3u);
  EXPECT_EQ(answers.at(1)->bytes_sent(), 1u);
  EXPECT_EQ(answers.at(3)->bytes_sent(), 3u);
  EXPECT_STATUS(answers.at(2).status(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(answers.at(2).status().message(), "refused");
}

}  // namespace
}  // namespace moesnap::daemon::cluster
