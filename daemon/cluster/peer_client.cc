// GrpcPeerClient: one channel per peer address, a deadline per kind of call, one quick retry of
// calls that only read, and a commit round's calls on one completion queue. PeerClient's own
// rounds, for clients that make one call at a time: a thread per call.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "daemon/cluster/node_table.h"
#include "daemon/cluster/peer_client.h"
#include "proto/moesnap.grpc.pb.h"

namespace moesnap::daemon::cluster {
namespace {

// Control calls answer at once unless the peer is gone.
constexpr absl::Duration kControlDeadline = absl::Seconds(10);
// A node answers what it holds from memory.
constexpr absl::Duration kGroupStateDeadline = absl::Seconds(2);
constexpr absl::Duration kDescribeDeadline = absl::Seconds(2);
// Bulk pushes return once every frame is on the wire.
constexpr absl::Duration kSendUnitsDeadline = absl::Minutes(10);
constexpr absl::Duration kRebuildDeadline = absl::Hours(1);
constexpr int kMaxMessageBytes = 64 << 20;

std::shared_ptr<grpc::ChannelCredentials> PeerChannelCredentials(const PeerTls* tls) {
  if (tls == nullptr) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = tls->ca_pem();
  ssl.pem_cert_chain = tls->cert_pem();
  ssl.pem_private_key = tls->key_pem();
  return grpc::SslCredentials(ssl);
}

// Whether a call that failed this way may simply be made again.
bool Retriable(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE;
}

// A failed call's status: transport failures say which call to which node; the peer's own answers
// pass unchanged.
absl::Status FailureOf(const char* name, uint32_t node, const grpc::Status& status) {
  const absl::Status converted = FromGrpcStatus(status);
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::Status(converted.code(),
                        absl::StrCat(name, " to node ", node, ": ", converted.message()));
  }
  return converted;
}

// How long a call of a commit round may take: the request's own timeout on the peer, and more.
template <typename Request>
absl::Duration RoundTimeout(const Request& request) {
  return absl::Milliseconds(request.timeout_ms()) + kControlDeadline;
}

// A round's request, held in its list of calls or lent to it.
template <typename Request>
const Request& RequestOf(const Request& request) {
  return request;
}
template <typename Request>
const Request& RequestOf(const Request* request) {
  return *request;
}

// PeerClient's rounds: each call on a thread of its own, the answers handed to the calling
// thread as they come.
template <typename Held, typename Response, typename Call>
void EachOnThreads(absl::Span<const std::pair<uint32_t, Held>> calls, Call call,
                   const PeerClient::Answered<Response>& done) {
  absl::Mutex mutex;
  std::deque<std::pair<uint32_t, absl::StatusOr<Response>>> answers;
  std::vector<std::thread> threads;
  threads.reserve(calls.size());
  for (const std::pair<uint32_t, Held>& node_call : calls) {
    threads.emplace_back([&] {
      absl::StatusOr<Response> answer = call(node_call.first, RequestOf(node_call.second));
      absl::MutexLock lock(&mutex);
      answers.emplace_back(node_call.first, std::move(answer));
    });
  }
  for (size_t handed = 0; handed < calls.size(); ++handed) {
    std::pair<uint32_t, absl::StatusOr<Response>> answer;
    {
      absl::MutexLock lock(&mutex);
      mutex.Await(absl::Condition(
          +[](std::deque<std::pair<uint32_t, absl::StatusOr<Response>>>* waiting) {
            return !waiting->empty();
          },
          &answers));
      answer = std::move(answers.front());
      answers.pop_front();
    }
    done(answer.first, std::move(answer.second));
  }
  for (std::thread& thread : threads) thread.join();
}

class GrpcPeerClient final : public PeerClient {
 public:
  GrpcPeerClient(const NodeTable* nodes, const PeerClientOptions& options)
      : nodes_(nodes), options_(options), credentials_(PeerChannelCredentials(options.tls.get())) {}

  absl::StatusOr<v1::NodeReport> Describe(uint32_t node) override {
    return Call<v1::NodeReport>(node, "Describe", &v1::Peer::Stub::Describe, v1::DescribeRequest(),
                                kDescribeDeadline, /*reads_only=*/true);
  }
  absl::StatusOr<v1::ProposeResponse> Propose(uint32_t node,
                                              const v1::ProposeRequest& request) override {
    return Call<v1::ProposeResponse>(node, "Propose", &v1::Peer::Stub::Propose, request,
                                     kControlDeadline, false);
  }
  absl::StatusOr<v1::PrepareResponse> Prepare(uint32_t node,
                                              const v1::PrepareRequest& request) override {
    return Call<v1::PrepareResponse>(node, "Prepare", &v1::Peer::Stub::Prepare, request,
                                     RoundTimeout(request), false);
  }
  absl::StatusOr<v1::EncodeResponse> Encode(uint32_t node,
                                            const v1::EncodeRequest& request) override {
    return Call<v1::EncodeResponse>(node, "Encode", &v1::Peer::Stub::Encode, request,
                                    RoundTimeout(request), false);
  }
  void PrepareEach(absl::Span<const std::pair<uint32_t, v1::PrepareRequest>> calls,
                   const Answered<v1::PrepareResponse>& done) override {
    CallEach<v1::PrepareResponse>("Prepare", &v1::Peer::Stub::AsyncPrepare, calls, done);
  }
  void EncodeEach(absl::Span<const std::pair<uint32_t, const v1::EncodeRequest*>> calls,
                  const Answered<v1::EncodeResponse>& done) override {
    CallEach<v1::EncodeResponse>("Encode", &v1::Peer::Stub::AsyncEncode, calls, done);
  }
  absl::StatusOr<v1::GroupStateResponse> GroupState(uint32_t node) override {
    return Call<v1::GroupStateResponse>(node, "GroupState", &v1::Peer::Stub::GroupState,
                                        v1::GroupStateRequest(), kGroupStateDeadline, true);
  }
  absl::StatusOr<v1::SendUnitsResponse> SendUnits(uint32_t node,
                                                  const v1::SendUnitsRequest& request) override {
    return Call<v1::SendUnitsResponse>(node, "SendUnits", &v1::Peer::Stub::SendUnits, request,
                                       kSendUnitsDeadline, false);
  }
  absl::StatusOr<v1::DecodeUnitsResponse> DecodeUnits(
      uint32_t node, const v1::DecodeUnitsRequest& request) override {
    return Call<v1::DecodeUnitsResponse>(node, "DecodeUnits", &v1::Peer::Stub::DecodeUnits,
                                         request, kSendUnitsDeadline, false);
  }
  absl::StatusOr<v1::RebuildResponse> Rebuild(uint32_t node) override {
    return Call<v1::RebuildResponse>(node, "Rebuild", &v1::Peer::Stub::Rebuild,
                                     v1::PeerRebuildRequest(), kRebuildDeadline, false);
  }
  absl::StatusOr<v1::LocateRankResponse> LocateRank(
      uint32_t node, const v1::LocateRankRequest& request) override {
    return Call<v1::LocateRankResponse>(node, "LocateRank", &v1::Peer::Stub::LocateRank, request,
                                        kControlDeadline, true);
  }
  absl::StatusOr<v1::FetchLogResponse> FetchLog(uint32_t node,
                                                const v1::FetchLogRequest& request) override {
    return Call<v1::FetchLogResponse>(node, "FetchLog", &v1::Peer::Stub::FetchLog, request,
                                      kControlDeadline, true);
  }
  absl::StatusOr<v1::DurableStateResponse> DurableState(uint32_t node,
                                                        absl::Time deadline) override {
    return Call<v1::DurableStateResponse>(node, "DurableState", &v1::Peer::Stub::DurableState,
                                          v1::DurableStateRequest(),
                                          std::min(deadline - absl::Now(), kControlDeadline), true);
  }

  uint64_t calls() const override { return calls_; }

 private:
  template <typename Response, typename Request, typename Method>
  absl::StatusOr<Response> Call(uint32_t node, const char* name, Method method,
                                const Request& request, absl::Duration timeout, bool reads_only) {
    const absl::Time deadline = absl::Now() + timeout;
    grpc::Status status;
    for (int attempt = 0; attempt < (reads_only ? 2 : 1); ++attempt) {
      absl::StatusOr<v1::Peer::Stub*> stub = Stub(node);
      if (!stub.ok()) return stub.status();
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(deadline));
      Response response;
      ++calls_;
      status = ((*stub)->*method)(&context, request, &response);
      if (status.ok()) return response;
      if (!Retriable(status) || absl::Now() >= deadline) break;
    }
    return FailureOf(name, node, status);
  }

  // A round's calls, all started from this thread and waited on together (one completion queue),
  // so that a round of a thousand nodes starts no thread.
  template <typename Response, typename Held, typename AsyncMethod>
  void CallEach(const char* name, AsyncMethod method,
                absl::Span<const std::pair<uint32_t, Held>> calls,
                const Answered<Response>& done) {
    struct InFlight {
      uint32_t node = 0;
      grpc::ClientContext context;
      Response response;
      grpc::Status status;
      std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> reader;
    };
    grpc::CompletionQueue queue;
    std::vector<std::unique_ptr<InFlight>> in_flight;
    std::vector<std::pair<uint32_t, absl::Status>> not_called;
    for (const auto& [node, held] : calls) {
      const auto& request = RequestOf(held);
      absl::StatusOr<v1::Peer::Stub*> stub = Stub(node);
      if (!stub.ok()) {
        not_called.emplace_back(node, stub.status());
        continue;
      }
      auto call = std::make_unique<InFlight>();
      call->node = node;
      call->context.set_deadline(absl::ToChronoTime(absl::Now() + RoundTimeout(request)));
      ++calls_;
      call->reader = ((*stub)->*method)(&call->context, request, &queue);
      call->reader->Finish(&call->response, &call->status, call.get());
      in_flight.push_back(std::move(call));
    }
    for (auto& [node, status] : not_called) done(node, std::move(status));
    for (size_t answered = 0; answered < in_flight.size(); ++answered) {
      void* tag = nullptr;
      bool ok = false;
      if (!queue.Next(&tag, &ok)) break;  // only after Shutdown, below
      InFlight* call = static_cast<InFlight*>(tag);
      if (call->status.ok()) {
        done(call->node, std::move(call->response));
      } else {
        done(call->node, FailureOf(name, call->node, call->status));
      }
    }
    queue.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (queue.Next(&tag, &ok)) {
    }
  }

  // The stub for `node`'s current address, made on first use and again when the address changes.
  absl::StatusOr<v1::Peer::Stub*> Stub(uint32_t node) {
    const std::optional<ClusterNode> address = nodes_->Address(node);
    if (!address) {
      return absl::UnavailableError(absl::StrCat("node ", node, " is lost (no daemon holds it)"));
    }
    // An IPv6 address goes in brackets before its port.
    const bool bracket = address->host.find(':') != std::string::npos && address->host[0] != '[';
    const std::string target = absl::StrCat(bracket ? "[" : "", address->host, bracket ? "]" : "",
                                            ":", address->control_port);
    absl::MutexLock lock(&mutex_);
    Channel& channel = channels_[node];
    if (channel.stub == nullptr || channel.target != target) {
      // Reconnect soon: a restarted peer must be reached as soon as it answers.
      grpc::ChannelArguments arguments;
      const int backoff_ms =
          static_cast<int>(absl::ToInt64Milliseconds(options_.reconnect_backoff));
      arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, backoff_ms);
      arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, backoff_ms);
      arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, backoff_ms);
      arguments.SetMaxReceiveMessageSize(kMaxMessageBytes);
      // This daemon's connections are its own: daemons in one process (the benchmarks' clusters)
      // would otherwise share one connection per peer, which the peer bounds as one caller.
      arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      // The server's certificate must name the node called, wherever it runs: peers are checked
      // by name, not by address (a replacement may come up on any host).
      if (options_.tls != nullptr) {
        arguments.SetSslTargetNameOverride(
            PeerServerName({options_.tls->self().job, node}));
      }
      // A call in flight may still use the old stub: it is kept, not destroyed.
      if (channel.stub != nullptr) retired_.push_back(std::move(channel.stub));
      channel.target = target;
      channel.stub = v1::Peer::NewStub(
          grpc::CreateCustomChannel(target, credentials_, arguments));
    }
    return channel.stub.get();
  }

  struct Channel {
    std::string target;
    std::unique_ptr<v1::Peer::Stub> stub;
  };

  const NodeTable* const nodes_;
  const PeerClientOptions options_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::atomic<uint64_t> calls_{0};
  absl::Mutex mutex_;
  std::map<uint32_t, Channel> channels_ ABSL_GUARDED_BY(mutex_);
  // Stubs of addresses a node no longer has; one per address change, kept while the client lives.
  std::vector<std::unique_ptr<v1::Peer::Stub>> retired_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace

void PeerClient::PrepareEach(absl::Span<const std::pair<uint32_t, v1::PrepareRequest>> calls,
                             const Answered<v1::PrepareResponse>& done) {
  EachOnThreads<v1::PrepareRequest, v1::PrepareResponse>(
      calls, [this](uint32_t node, const v1::PrepareRequest& request) {
        return Prepare(node, request);
      }, done);
}

void PeerClient::EncodeEach(
    absl::Span<const std::pair<uint32_t, const v1::EncodeRequest*>> calls,
    const Answered<v1::EncodeResponse>& done) {
  EachOnThreads<const v1::EncodeRequest*, v1::EncodeResponse>(
      calls, [this](uint32_t node, const v1::EncodeRequest& request) {
        return Encode(node, request);
      }, done);
}

std::unique_ptr<PeerClient> NewGrpcPeerClient(const NodeTable* nodes,
                                              const PeerClientOptions& options) {
  return std::make_unique<GrpcPeerClient>(nodes, options);
}

}  // namespace moesnap::daemon::cluster
