// PeerTls: the job's CA as an OpenSSL store, this node's own certificate checked at load, and the
// check of a peer's certificate shared by the Peer service and the data plane.
#include "daemon/peer_tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/metrics.h"

namespace moesnap::daemon {
namespace {

constexpr absl::string_view kUriScheme = "moesnap://";
constexpr absl::string_view kNodePart = "/node/";

bool ValidJobName(absl::string_view job) {
  if (job.empty() || job.size() > 128) return false;
  for (char c : job) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.';
    if (!ok) return false;
  }
  return true;
}

// The newest OpenSSL error, as text; clears the queue.
std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "no detail";
  std::array<char, 256> text{};
  ERR_error_string_n(code, text.data(), text.size());
  return text.data();
}

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* certificate) const { X509_free(certificate); }
};
struct KeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using Certificate = std::unique_ptr<X509, X509Free>;

// Every certificate in a PEM text, in order.
std::vector<Certificate> ReadCertificates(absl::string_view pem) {
  std::vector<Certificate> certificates;
  std::unique_ptr<BIO, BioFree> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  if (bio == nullptr) return certificates;
  while (X509* certificate = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    certificates.emplace_back(certificate);
  }
  ERR_clear_error();  // the end of the text reads as an error
  return certificates;
}

absl::StatusOr<std::string> ReadFile(const char* key, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read tls.", key, " '", path, "': ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << file.rdbuf();
  if (contents.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls.", key, " '", path, "' holds no PEM block (no '-----BEGIN ')"));
  }
  return contents.str();
}

// Verifies `leaf` (with `chain` as intermediates) against `store` now; empty when it holds.
std::string Verify(X509_STORE* store, X509* leaf, const std::vector<Certificate>& chain) {
  STACK_OF(X509)* untrusted = sk_X509_new_null();
  for (const Certificate& certificate : chain) {
    if (certificate.get() != leaf) sk_X509_push(untrusted, certificate.get());
  }
  X509_STORE_CTX* context = X509_STORE_CTX_new();
  std::string failure;
  if (context == nullptr || X509_STORE_CTX_init(context, store, leaf, untrusted) != 1) {
    failure = absl::StrCat("cannot set up the check: ", OpenSslError());
  } else if (X509_verify_cert(context) != 1) {
    failure = X509_verify_cert_error_string(X509_STORE_CTX_get_error(context));
  }
  X509_STORE_CTX_free(context);
  sk_X509_free(untrusted);
  ERR_clear_error();
  return failure;
}

struct RefusalLog {
  std::mutex mutex;
  std::string last;
  uint64_t total = 0;
  std::array<absl::Time, 2> logged_at{absl::InfinitePast(), absl::InfinitePast()};
  std::array<uint64_t, 2> unlogged{0, 0};
};
RefusalLog& Refusals() {
  static RefusalLog* log = new RefusalLog;
  return *log;
}

}  // namespace

std::string PeerUri(const PeerIdentity& identity) {
  return absl::StrCat(kUriScheme, identity.job, kNodePart, identity.node_id);
}

std::string PeerServerName(const PeerIdentity& identity) {
  return absl::StrCat("node-", identity.node_id, ".", identity.job, ".moesnap");
}

absl::StatusOr<PeerIdentity> ParsePeerUri(absl::string_view uri) {
  auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("'", uri, "' is not moesnap://<job>/node/<id>: ",
                                                   why));
  };
  if (!absl::StartsWith(uri, kUriScheme)) return refuse("another scheme");
  absl::string_view rest = uri.substr(kUriScheme.size());
  const size_t node = rest.find(kNodePart);
  if (node == absl::string_view::npos) return refuse("no /node/ part");
  PeerIdentity identity;
  identity.job = std::string(rest.substr(0, node));
  if (!ValidJobName(identity.job)) {
    return refuse("the job is not 1-128 letters, digits, '-', '_' or '.'");
  }
  const absl::string_view id = rest.substr(node + kNodePart.size());
  if (id.empty() || id.size() > 10 || id.find_first_not_of("0123456789") != absl::string_view::npos ||
      (id.size() > 1 && id[0] == '0') || !absl::SimpleAtoi(id, &identity.node_id)) {
    return refuse("the node id is not a decimal integer below 2^32");
  }
  return identity;
}

absl::StatusOr<PeerIdentity> IdentityOfCertificate(X509* certificate) {
  auto* names = static_cast<GENERAL_NAMES*>(
      X509_get_ext_d2i(certificate, NID_subject_alt_name, nullptr, nullptr));
  std::vector<std::string> uris;
  for (int i = 0; names != nullptr && i < sk_GENERAL_NAME_num(names); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names, i);
    if (name->type != GEN_URI) continue;
    const ASN1_IA5STRING* uri = name->d.uniformResourceIdentifier;
    const std::string text(reinterpret_cast<const char*>(ASN1_STRING_get0_data(uri)),
                           static_cast<size_t>(ASN1_STRING_length(uri)));
    if (absl::StartsWith(text, kUriScheme)) uris.push_back(text);
  }
  GENERAL_NAMES_free(names);
  if (uris.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the certificate names ", uris.size(),
                     " moesnap:// identities in its subject alternative names (one is needed: "
                     "URI moesnap://<job>/node/<id>)"));
  }
  return ParsePeerUri(uris.front());
}

absl::string_view PeerRefusalLabel(PeerRefusal refusal) {
  switch (refusal) {
    case PeerRefusal::kNoCertificate: return "no_certificate";
    case PeerRefusal::kUntrustedCertificate: return "untrusted_certificate";
    case PeerRefusal::kOtherJob: return "other_job";
    case PeerRefusal::kOtherNode: return "other_node";
    case PeerRefusal::kHandshake: return "handshake";
  }
  return "unknown";
}

void RecordPeerRefusal(PeerPlane plane, PeerRefusal refusal, absl::string_view message) {
  const absl::string_view plane_label = plane == PeerPlane::kControl ? "control" : "data";
  metrics::Registry::Default()
      .AddCounter("moesnap_peer_refusals_total",
                  "Peers refused by mutual TLS, by plane (control: the Peer service, data: the "
                  "data plane) and reason",
                  {{"plane", std::string(plane_label)},
                   {"reason", std::string(PeerRefusalLabel(refusal))}})
      .Add();
  RefusalLog& log = Refusals();
  const std::string line = absl::StrCat(plane == PeerPlane::kControl ? "Peer service" : "data plane",
                                        ": refused a peer (", PeerRefusalLabel(refusal), "): ",
                                        message);
  uint64_t unlogged = 0;
  {
    std::lock_guard<std::mutex> lock(log.mutex);
    ++log.total;
    log.last = line;
    const size_t index = plane == PeerPlane::kControl ? 0 : 1;
    const absl::Time now = absl::Now();
    if (now - log.logged_at[index] < absl::Seconds(1)) {
      ++log.unlogged[index];
      return;
    }
    log.logged_at[index] = now;
    unlogged = std::exchange(log.unlogged[index], 0);
  }
  if (unlogged > 0) {
    Log(LogLevel::kWarning, line, " (and ", unlogged, " more refusals in the last second)");
  } else {
    Log(LogLevel::kWarning, line);
  }
}

PeerRefusalSummary PeerRefusals() {
  RefusalLog& log = Refusals();
  std::lock_guard<std::mutex> lock(log.mutex);
  return {log.total, log.last};
}

absl::StatusOr<std::shared_ptr<const PeerTls>> PeerTls::Load(const TlsOptions& options,
                                                             absl::string_view job,
                                                             uint32_t node_id,
                                                             uint32_t node_count) {
  std::shared_ptr<PeerTls> tls(new PeerTls);
  tls->self_ = {std::string(job), node_id};
  tls->node_count_ = node_count;
  absl::StatusOr<std::string> ca = ReadFile("ca_file", options.ca_file);
  if (!ca.ok()) return ca.status();
  absl::StatusOr<std::string> cert = ReadFile("cert_file", options.cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFile("key_file", options.key_file);
  if (!key.ok()) return key.status();
  tls->ca_pem_ = *std::move(ca);
  tls->cert_pem_ = *std::move(cert);
  tls->key_pem_ = *std::move(key);

  tls->store_ = X509_STORE_new();
  const std::vector<Certificate> authorities = ReadCertificates(tls->ca_pem_);
  if (tls->store_ == nullptr || authorities.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls.ca_file '", options.ca_file, "' holds no readable certificate"));
  }
  for (const Certificate& authority : authorities) X509_STORE_add_cert(tls->store_, authority.get());

  const std::vector<Certificate> own = ReadCertificates(tls->cert_pem_);
  if (own.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls.cert_file '", options.cert_file, "' holds no readable certificate"));
  }
  if (const std::string failure = Verify(tls->store_, own.front().get(), own); !failure.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("tls.cert_file '", options.cert_file,
                                                   "' does not check against tls.ca_file '",
                                                   options.ca_file, "': ", failure));
  }
  absl::StatusOr<PeerIdentity> named = IdentityOfCertificate(own.front().get());
  if (!named.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls.cert_file '", options.cert_file, "': ", named.status().message()));
  }
  if (*named != tls->self_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls.cert_file '", options.cert_file, "' names ", PeerUri(*named), ", this daemon is ",
        PeerUri(tls->self_), " (make the node's certificate with deploy/make-certs.sh)"));
  }
  std::unique_ptr<BIO, BioFree> key_bio(
      BIO_new_mem_buf(tls->key_pem_.data(), static_cast<int>(tls->key_pem_.size())));
  std::unique_ptr<EVP_PKEY, KeyFree> private_key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (private_key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("tls.key_file '", options.key_file,
                                                   "' holds no readable private key (",
                                                   OpenSslError(), ")"));
  }
  if (X509_check_private_key(own.front().get(), private_key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("tls.key_file '", options.key_file,
                                                   "' is not the key of tls.cert_file '",
                                                   options.cert_file, "'"));
  }
  return std::shared_ptr<const PeerTls>(std::move(tls));
}

PeerTls::~PeerTls() { X509_STORE_free(store_); }

absl::StatusOr<PeerIdentity> PeerTls::Check(absl::string_view certificate_pem,
                                            absl::string_view chain_pem,
                                            PeerRefusal* refusal) const {
  auto refuse = [&](PeerRefusal why, std::string message) {
    if (refusal != nullptr) *refusal = why;
    return absl::UnauthenticatedError(std::move(message));
  };
  if (certificate_pem.empty()) {
    return refuse(PeerRefusal::kNoCertificate,
                  absl::StrCat("the peer presented no certificate (", PeerUri(self_),
                               " takes calls only from nodes of its job, with mutual TLS)"));
  }
  const std::vector<Certificate> leaf = ReadCertificates(certificate_pem);
  if (leaf.empty()) {
    return refuse(PeerRefusal::kUntrustedCertificate, "the peer's certificate cannot be read");
  }
  const std::vector<Certificate> chain = ReadCertificates(chain_pem);
  if (const std::string failure = Verify(store_, leaf.front().get(), chain); !failure.empty()) {
    return refuse(PeerRefusal::kUntrustedCertificate,
                  absl::StrCat("the peer's certificate does not check against job '", self_.job,
                               "''s CA: ", failure));
  }
  return CheckName(leaf.front().get(), refusal);
}

absl::StatusOr<PeerIdentity> PeerTls::CheckName(X509* certificate, PeerRefusal* refusal) const {
  auto refuse = [&](PeerRefusal why, std::string message) {
    if (refusal != nullptr) *refusal = why;
    return absl::UnauthenticatedError(std::move(message));
  };
  absl::StatusOr<PeerIdentity> identity = IdentityOfCertificate(certificate);
  if (!identity.ok()) {
    return refuse(PeerRefusal::kOtherJob,
                  absl::StrCat("the peer's certificate: ", identity.status().message()));
  }
  if (identity->job != self_.job) {
    return refuse(PeerRefusal::kOtherJob,
                  absl::StrCat("the peer's certificate names job '", identity->job,
                               "' (", PeerUri(*identity), "); this is job '", self_.job, "'"));
  }
  if (identity->node_id >= node_count_) {
    return refuse(PeerRefusal::kOtherNode,
                  absl::StrCat("the peer's certificate names node ", identity->node_id,
                               "; job '", self_.job, "' has nodes 0..", node_count_ - 1));
  }
  return identity;
}

}  // namespace moesnap::daemon
