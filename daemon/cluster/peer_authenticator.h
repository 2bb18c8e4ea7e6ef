// Who calls this node's Peer service. With mutual TLS, every call is checked against the job's CA
// and names its caller: the node its certificate names (PeerTls::Check), and a request that acts as
// a node (a proposal's from_node, a coordinator's calls, a transfer's to_node) must come from that
// node, so that no node acts as another. Without TLS (tls.insecure, loopback only) every caller is
// let in, unnamed. Refusals are counted and logged (RecordPeerRefusal).
//
// The TLS layer asks for a client certificate without checking it: the check is here, on every
// call, against the same CA, so that a refusal is counted and answered with its reason; a handshake
// gRPC refused itself would be neither.
#ifndef MOESNAP_DAEMON_CLUSTER_PEER_AUTHENTICATOR_H_
#define MOESNAP_DAEMON_CLUSTER_PEER_AUTHENTICATOR_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/peer_tls.h"

namespace moesnap::daemon::cluster {

// Thread-safe.
class PeerAuthenticator {
 public:
  // `tls` null: plaintext, every caller let in.
  explicit PeerAuthenticator(std::shared_ptr<const PeerTls> tls) : tls_(std::move(tls)) {}

  // The calling node (nullopt without TLS); UNAUTHENTICATED naming what is wrong with its
  // certificate.
  absl::StatusOr<std::optional<uint32_t>> Caller(const grpc::AuthContext& context) const;
  // OK when the request's `field` (the node it acts as) is the caller itself, or without TLS;
  // PERMISSION_DENIED naming both otherwise.
  absl::Status ActsAs(const std::optional<uint32_t>& caller, uint32_t claimed,
                      absl::string_view field) const;

  // The server credentials of the Peer service.
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;

 private:
  const std::shared_ptr<const PeerTls> tls_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_PEER_AUTHENTICATOR_H_
