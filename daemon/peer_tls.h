// Mutual TLS between the daemons of a job. A node's certificate, signed by the job's CA, names its
// holder with a SAN URI moesnap://<job>/node/<id>, and carries the DNS name node-<id>.<job>.moesnap
// that a client connecting to node <id> expects of the server (deploy/make-certs.sh makes both).
// PeerTls holds this node's CA, certificate and key, and checks a peer's certificate the same way for
// the Peer service and the data plane: signed by the job's CA, valid now, naming this job and a
// node of it. Refusals are counted per plane and reason (moesnap_peer_refusals_total) and the last
// one is kept for `moesnapctl cluster status`.
#ifndef MOESNAP_DAEMON_PEER_TLS_H_
#define MOESNAP_DAEMON_PEER_TLS_H_

#include <openssl/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moesnap::daemon {

// [tls]: the files of this node (paths may hold "{node}", replaced by the node id, so that one
// config serves every node), or plaintext on loopback when insecure.
struct TlsOptions {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  bool insecure = false;

  bool enabled() const { return !insecure; }
};

// Who holds a certificate.
struct PeerIdentity {
  std::string job;
  uint32_t node_id = 0;
  bool operator==(const PeerIdentity&) const = default;
};

// "moesnap://<job>/node/<id>": the SAN URI naming a node.
std::string PeerUri(const PeerIdentity& identity);
// "node-<id>.<job>.moesnap": the DNS name a client connecting to the node checks.
std::string PeerServerName(const PeerIdentity& identity);
// Parses a SAN URI; INVALID_ARGUMENT says what is not of the form moesnap://<job>/node/<id>.
absl::StatusOr<PeerIdentity> ParsePeerUri(absl::string_view uri);
// The identity a certificate's SAN names: exactly one moesnap:// URI among its names.
absl::StatusOr<PeerIdentity> IdentityOfCertificate(X509* certificate);

// Why a peer was refused (the label of moesnap_peer_refusals_total{reason}).
enum class PeerRefusal {
  kNoCertificate,         // presented none
  kUntrustedCertificate,  // not signed by the job's CA, expired, not yet valid, malformed
  kOtherJob,              // names another job (or no moesnap:// identity)
  kOtherNode,             // names a node outside the job, or acts as a node it is not
  kHandshake,             // the TLS handshake failed otherwise (plaintext, bad protocol, timeout)
};
absl::string_view PeerRefusalLabel(PeerRefusal refusal);

// Which plane refused: the Peer service ("control") or the data plane ("data").
enum class PeerPlane { kControl, kData };

// Counts a refusal, logs it (at most one line a second per plane; the count is exact) and keeps it
// as the last refusal. Thread-safe.
void RecordPeerRefusal(PeerPlane plane, PeerRefusal refusal, absl::string_view message);
struct PeerRefusalSummary {
  uint64_t total = 0;
  std::string last;  // the last refusal's plane and message; empty when none
};
PeerRefusalSummary PeerRefusals();

class PeerTls {
 public:
  // Reads the CA, this node's certificate and key. The certificate must be signed by the CA, valid
  // now, name (job, node_id), and match the key: a node that could not authenticate is refused at
  // start, naming the file at fault. `node_count` bounds the node ids peers may name.
  static absl::StatusOr<std::shared_ptr<const PeerTls>> Load(const TlsOptions& options,
                                                             absl::string_view job,
                                                             uint32_t node_id,
                                                             uint32_t node_count);
  ~PeerTls();
  PeerTls(const PeerTls&) = delete;
  PeerTls& operator=(const PeerTls&) = delete;

  const std::string& ca_pem() const { return ca_pem_; }
  const std::string& cert_pem() const { return cert_pem_; }
  const std::string& key_pem() const { return key_pem_; }
  const PeerIdentity& self() const { return self_; }

  // Checks a peer's certificate (PEM; empty: it presented none), with the other certificates it
  // sent as possible intermediates (`chain_pem`): signed by the job's CA and valid now, naming this
  // job and a node below node_count. UNAUTHENTICATED saying which check failed; `refusal` (when
  // not null) says why, for counting.
  absl::StatusOr<PeerIdentity> Check(absl::string_view certificate_pem, absl::string_view chain_pem,
                                     PeerRefusal* refusal) const;
  // The same for a certificate a TLS handshake already verified against the CA (the data plane):
  // its name only.
  absl::StatusOr<PeerIdentity> CheckName(X509* certificate, PeerRefusal* refusal) const;

 private:
  PeerTls() = default;
  std::string ca_pem_;
  std::string cert_pem_;
  std::string key_pem_;
  PeerIdentity self_;
  uint32_t node_count_ = 0;
  X509_STORE* store_ = nullptr;  // the job's CA
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_PEER_TLS_H_
