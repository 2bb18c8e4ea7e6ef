// The one place where this node calls its peers' Peer service: channels and their credentials
// (mutual TLS), the deadline of every call, retries of calls that read and change nothing,
// and conversion of gRPC status into absl::Status. Units call a PeerClient, never a stub; unit
// tests put a fake in its place.
#ifndef MOESNAP_DAEMON_CLUSTER_PEER_CLIENT_H_
#define MOESNAP_DAEMON_CLUSTER_PEER_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/peer_tls.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::cluster {

class NodeTable;

// Every method is thread-safe and names the node in transport failures ("Prepare to node 3: ...");
// a status the peer itself returned comes back unchanged.
class PeerClient {
 public:
  virtual ~PeerClient() = default;

  virtual absl::StatusOr<v1::NodeReport> Describe(uint32_t node) = 0;
  virtual absl::StatusOr<v1::ProposeResponse> Propose(uint32_t node,
                                                      const v1::ProposeRequest& request) = 0;
  // Prepare and Encode may take the request's timeout_ms on the peer, and a little more.
  virtual absl::StatusOr<v1::PrepareResponse> Prepare(uint32_t node,
                                                      const v1::PrepareRequest& request) = 0;
  virtual absl::StatusOr<v1::EncodeResponse> Encode(uint32_t node,
                                                    const v1::EncodeRequest& request) = 0;
  // A round of Prepare (Encode) calls: every call of `calls` (a node and its request) is made at
  // once, and `done` runs on the calling thread for each answer as it comes, in that order; a
  // node that cannot be called answers first. Returns once every call has answered. This
  // implementation makes each call on a thread of its own; a client that can wait on many calls
  // from one thread does so. An Encode round's requests are lent (they carry every group member's
  // image, the same in each request of a group) and need live only until the round returns.
  template <typename Response>
  using Answered = std::function<void(uint32_t node, absl::StatusOr<Response> answer)>;
  virtual void PrepareEach(absl::Span<const std::pair<uint32_t, v1::PrepareRequest>> calls,
                           const Answered<v1::PrepareResponse>& done);
  virtual void EncodeEach(absl::Span<const std::pair<uint32_t, const v1::EncodeRequest*>> calls,
                          const Answered<v1::EncodeResponse>& done);
  virtual absl::StatusOr<v1::GroupStateResponse> GroupState(uint32_t node) = 0;
  virtual absl::StatusOr<v1::SendUnitsResponse> SendUnits(uint32_t node,
                                                          const v1::SendUnitsRequest& request) = 0;
  virtual absl::StatusOr<v1::DecodeUnitsResponse> DecodeUnits(
      uint32_t node, const v1::DecodeUnitsRequest& request) = 0;
  virtual absl::StatusOr<v1::RebuildResponse> Rebuild(uint32_t node) = 0;
  virtual absl::StatusOr<v1::LocateRankResponse> LocateRank(
      uint32_t node, const v1::LocateRankRequest& request) = 0;
  virtual absl::StatusOr<v1::FetchLogResponse> FetchLog(uint32_t node,
                                                        const v1::FetchLogRequest& request) = 0;

  // Calls made so far (each attempt counts), for the per-step figures.
  virtual uint64_t calls() const = 0;
  // Waits for the answer until `deadline` at most.
  virtual absl::StatusOr<v1::DurableStateResponse> DurableState(uint32_t node,
                                                                absl::Time deadline) = 0;
};

struct PeerClientOptions {
  // How soon a channel to a peer that went away tries to connect again.
  absl::Duration reconnect_backoff = absl::Milliseconds(500);
  // Mutual TLS: this node's certificate, the job's CA, and each peer's certificate must name the
  // node called (PeerServerName). Null: plaintext.
  std::shared_ptr<const PeerTls> tls;
};

// Over gRPC, to the addresses in `nodes` (a channel is made again when a node's address changes);
// a node no daemon holds is UNAVAILABLE at once. `nodes` must outlive the client.
std::unique_ptr<PeerClient> NewGrpcPeerClient(const NodeTable* nodes,
                                              const PeerClientOptions& options);

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_PEER_CLIENT_H_
