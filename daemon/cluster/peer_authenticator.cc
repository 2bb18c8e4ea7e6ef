// PeerAuthenticator: the caller's certificate from gRPC's auth context, checked by PeerTls.
#include "daemon/cluster/peer_authenticator.h"

#include <grpc/grpc_security_constants.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace moesnap::daemon::cluster {

absl::StatusOr<std::optional<uint32_t>> PeerAuthenticator::Caller(
    const grpc::AuthContext& context) const {
  if (tls_ == nullptr) return std::optional<uint32_t>();
  // The peer's own certificate, and whatever else it sent (intermediates, perhaps the root).
  auto property = [&](const char* name) {
    const std::vector<grpc::string_ref> values = context.FindPropertyValues(name);
    return values.empty() ? absl::string_view()
                          : absl::string_view(values.front().data(), values.front().size());
  };
  const absl::string_view certificate = property(GRPC_X509_PEM_CERT_PROPERTY_NAME);
  const absl::string_view chain = property(GRPC_X509_PEM_CERT_CHAIN_PROPERTY_NAME);
  PeerRefusal refusal = PeerRefusal::kHandshake;
  absl::StatusOr<PeerIdentity> identity = tls_->Check(certificate, chain, &refusal);
  if (!identity.ok()) {
    RecordPeerRefusal(PeerPlane::kControl, refusal, identity.status().message());
    return identity.status();
  }
  return std::optional<uint32_t>(identity->node_id);
}

absl::Status PeerAuthenticator::ActsAs(const std::optional<uint32_t>& caller, uint32_t claimed,
                                       absl::string_view field) const {
  if (!caller || *caller == claimed) return absl::OkStatus();
  const std::string message =
      absl::StrCat("the caller's certificate names node ", *caller, " and the request acts as node ",
                   claimed, " (", field, "): a node acts only as itself");
  RecordPeerRefusal(PeerPlane::kControl, PeerRefusal::kOtherNode, message);
  return absl::PermissionDeniedError(message);
}

std::shared_ptr<grpc::ServerCredentials> PeerAuthenticator::ServerCredentials() const {
  if (tls_ == nullptr) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_BUT_DONT_VERIFY);
  ssl.pem_root_certs = tls_->ca_pem();
  ssl.pem_key_cert_pairs.push_back({tls_->key_pem(), tls_->cert_pem()});
  return grpc::SslServerCredentials(ssl);
}

}  // namespace moesnap::daemon::cluster
