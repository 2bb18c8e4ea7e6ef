// ClusterOptions: validation, groups, and the canonical form digests and differences come from.
#include "daemon/cluster_config.h"

#include <arpa/inet.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "erasure/stripe_layout.h"

namespace moesnap::daemon {
namespace {

// etcd cannot keep a lease shorter than about 2 s with its default election timeout.
constexpr uint32_t kMinLeaseTtlMs = 2000;

bool IsLoopback(const std::string& host) {
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  return inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

bool IsAddressLiteral(const std::string& host) {
  in6_addr scratch{};
  return inet_pton(AF_INET, host.c_str(), &scratch) == 1 ||
         inet_pton(AF_INET6, host.c_str(), &scratch) == 1;
}

// Job names become etcd key segments: no '/', nothing invisible.
bool ValidJobName(const std::string& job) {
  if (job.empty() || job.size() > 128) return false;
  for (char c : job) {
    const bool allowed = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                         c == '-' || c == '_' || c == '.';
    if (!allowed) return false;
  }
  return true;
}

}  // namespace

absl::Status ClusterOptions::ValidateShape() const {
  if (absl::StatusOr<erasure::StripeLayout> layout =
          erasure::StripeLayout::Create(data_units, parity_units, stripe_unit_bytes);
      !layout.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cluster: ", layout.status().message()));
  }
  if (!ValidJobName(job)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster.job must be 1-128 letters, digits, '-', '_' or '.', got '", job, "'"));
  }
  if (node_count == 0 || node_count % group_size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster.node_count: ", node_count, " nodes cannot form groups of k + m = ", group_size(),
        "; the node count must be a positive multiple of the group size"));
  }
  if (commit_timeout_ms < 100) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster.commit_timeout_ms must be at least 100, got ", commit_timeout_ms));
  }
  if (lease_ttl_ms < kMinLeaseTtlMs) {
    return absl::InvalidArgumentError(absl::StrCat("cluster.lease_ttl_ms must be at least ",
                                                   kMinLeaseTtlMs, " (etcd's shortest lease), got ",
                                                   lease_ttl_ms));
  }
  if (etcd_endpoints.empty()) {
    return absl::InvalidArgumentError("cluster.etcd_endpoints: a cluster needs etcd's address");
  }
  for (const std::string& endpoint : etcd_endpoints) {
    if (endpoint.empty() || endpoint.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cluster.etcd_endpoints: expected \"host:port\" entries, got '", endpoint, "'"));
    }
  }
  if (etcd_cert_file.empty() != etcd_key_file.empty()) {
    return absl::InvalidArgumentError(
        "cluster.etcd_cert_file and cluster.etcd_key_file go together (mutual TLS)");
  }
  return absl::OkStatus();
}

absl::Status ClusterOptions::Validate(uint32_t self) const {
  if (absl::Status status = ValidateShape(); !status.ok()) return status;
  if (self >= node_count) {
    return absl::InvalidArgumentError(absl::StrCat("node id ", self, " is not below cluster.node_count = ",
                                                   node_count));
  }
  if (advertise_host.empty()) {
    return absl::InvalidArgumentError(
        "cluster.advertise_host is not set: the address peers reach this node on (or "
        "--advertise-host, or MOESNAP_ADVERTISE_HOST)");
  }
  return ValidateTls();
}

absl::Status ClusterOptions::ValidateTls() const {
  const bool any_file = !tls.ca_file.empty() || !tls.cert_file.empty() || !tls.key_file.empty();
  if (tls.insecure) {
    if (any_file) {
      return absl::InvalidArgumentError(
          "tls.insecure = true and tls.ca_file/cert_file/key_file are both set: mutual TLS or "
          "plaintext, choose one");
    }
    if (!IsLoopback(ListenHost())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tls.insecure = true is for loopback only, and this node listens on ", ListenHost(),
          ": peers on a network authenticate with mutual TLS (set tls.ca_file, tls.cert_file and "
          "tls.key_file; deploy/make-certs.sh makes them)"));
    }
    return absl::OkStatus();
  }
  std::vector<std::string> missing;
  if (tls.ca_file.empty()) missing.push_back("tls.ca_file");
  if (tls.cert_file.empty()) missing.push_back("tls.cert_file");
  if (tls.key_file.empty()) missing.push_back("tls.key_file");
  if (!missing.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a cluster's peers authenticate with mutual TLS: ", absl::StrJoin(missing, ", "),
        missing.size() > 1 ? " are" : " is",
        " not set (deploy/make-certs.sh makes a job CA and node certificates), or set "
        "tls.insecure = true for plaintext on loopback"));
  }
  return absl::OkStatus();
}

TlsOptions ClusterOptions::NodeTls(uint32_t self) const {
  TlsOptions files = tls;
  for (std::string* path : {&files.ca_file, &files.cert_file, &files.key_file}) {
    *path = absl::StrReplaceAll(*path, {{"{node}", absl::StrCat(self)}});
  }
  return files;
}

etcd::TlsOptions ClusterOptions::EtcdTls(uint32_t self) const {
  if (!etcd_ca_file.empty() || tls.insecure) {
    return {etcd_ca_file, etcd_cert_file, etcd_key_file};
  }
  const TlsOptions files = NodeTls(self);
  return {files.ca_file, files.cert_file, files.key_file};
}

std::vector<std::vector<uint32_t>> ClusterOptions::Groups() const {
  std::vector<std::vector<uint32_t>> groups;
  for (uint32_t id = 0; id < node_count; ++id) {
    if (id % group_size() == 0) groups.emplace_back();
    groups.back().push_back(id);
  }
  return groups;
}

std::optional<std::pair<int, int>> ClusterOptions::GroupOf(uint32_t id) const {
  if (id >= node_count || group_size() <= 0) return std::nullopt;
  return std::pair<int, int>(static_cast<int>(id) / group_size(),
                             static_cast<int>(id) % group_size());
}

std::string ClusterOptions::ListenHost() const {
  if (!listen_host.empty()) return listen_host;
  return IsAddressLiteral(advertise_host) ? advertise_host : "0.0.0.0";
}

std::string ClusterOptions::Canonical() const {
  return absl::StrCat("job=", job, ";nodes=", node_count, ";k=", data_units, ";m=", parity_units,
                      ";unit=", stripe_unit_bytes, ";lease_ms=", lease_ttl_ms,
                      ";commit_ms=", commit_timeout_ms, ";degraded=", allow_degraded ? 1 : 0);
}

uint64_t ClusterOptions::Digest() const {
  uint64_t hash = 0xcbf29ce484222325ULL;  // FNV-1a, 64 bits: stable across builds and machines
  for (unsigned char c : Canonical()) {
    hash ^= c;
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

std::string ClusterOptions::DifferenceFrom(const ClusterOptions& other) const {
  auto differs = [](const std::string& field, const auto& here, const auto& there) {
    return absl::StrCat(field, ": ", here, " here, ", there, " there");
  };
  if (job != other.job) return differs("job", job, other.job);
  if (node_count != other.node_count) return differs("node_count", node_count, other.node_count);
  if (data_units != other.data_units) return differs("data_units", data_units, other.data_units);
  if (parity_units != other.parity_units) return differs("parity_units", parity_units, other.parity_units);
  if (stripe_unit_bytes != other.stripe_unit_bytes) {
    return differs("stripe_unit_bytes", stripe_unit_bytes, other.stripe_unit_bytes);
  }
  if (lease_ttl_ms != other.lease_ttl_ms) {
    return differs("lease_ttl_ms", lease_ttl_ms, other.lease_ttl_ms);
  }
  if (commit_timeout_ms != other.commit_timeout_ms) {
    return differs("commit_timeout_ms", commit_timeout_ms, other.commit_timeout_ms);
  }
  if (allow_degraded != other.allow_degraded) {
    return differs("allow_degraded", allow_degraded, other.allow_degraded);
  }
  return "";
}

}  // namespace moesnap::daemon
