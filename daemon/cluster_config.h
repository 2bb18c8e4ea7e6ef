// The cluster section of a daemon's config: the job (its name, where its etcd is, how many nodes,
// the Reed-Solomon shape of their groups, timeouts), which every daemon of the job must have the
// same, and this node's own part (the address and ports it advertises). Groups are formed
// deterministically: node ids 0 .. node_count - 1, cut into consecutive groups of k + m. Who holds
// each node id, and where, is found in etcd, not in the file: one file serves every node of a job
// when the node id and address come from the command line or the environment. A config without a
// cluster is a single node.
#ifndef MOESNAP_DAEMON_CLUSTER_CONFIG_H_
#define MOESNAP_DAEMON_CLUSTER_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/etcd/etcd_client.h"
#include "daemon/peer_tls.h"

namespace moesnap::daemon {

// Where a node is reached.
struct ClusterNode {
  uint32_t id = 0;
  std::string host;
  uint16_t control_port = 0;
  uint16_t data_port = 0;
};

struct ClusterOptions {
  // --- The job: equal on every node (compared through Digest when a daemon joins).
  std::string job = "moesnap";  // its keys live under /moesnap/<job>/ in etcd
  uint32_t node_count = 0;
  int data_units = 4;    // k
  int parity_units = 2;  // m
  uint64_t stripe_unit_bytes = uint64_t{4} << 20;
  uint32_t lease_ttl_ms = 10000;       // a node whose daemon is silent this long is lost
  uint32_t commit_timeout_ms = 60000;  // a step's trainers must capture it within this time
  bool allow_degraded = false;         // keep snapshotting with lost nodes in a group

  // --- Reaching etcd (may differ per node, e.g. the nearest member first).
  std::vector<std::string> etcd_endpoints = {"127.0.0.1:2379"};
  std::string etcd_ca_file;    // TLS to etcd when set
  std::string etcd_cert_file;  // with etcd_key_file: mutual TLS
  std::string etcd_key_file;

  // --- This node.
  std::string advertise_host;  // the address peers reach this node on (IP address or host name)
  std::string listen_host;     // empty: advertise_host if it is an IP address, else every address
  uint16_t control_port = 7440;  // the Peer service; 0: any free port (advertised as bound)
  uint16_t data_port = 7441;     // the data plane; 0: any free port
  uint32_t max_data_connections = 256;  // data-plane connections served at once
  // Host memory one elastic restore here fills with fetched (or decoded) bytes before writing
  // them into the rank: its regions go in batches of this many bytes (a larger region alone).
  uint64_t restore_buffer_bytes = uint64_t{256} << 20;
  static constexpr uint64_t kMinRestoreBufferBytes = uint64_t{1} << 20;
  // [tls]: mutual TLS with the job's peers (and etcd, unless the etcd_* files say otherwise).
  // Per node (file paths), so not part of the job's digest.
  TlsOptions tls;

  // The job's shape alone: k, m, unit, node count, timeouts, job name, endpoints.
  absl::Status ValidateShape() const;
  // The shape, and this node's part: an id below node_count, an address to advertise, and its
  // TLS (ValidateTls).
  absl::Status Validate(uint32_t self) const;
  // Mutual TLS needs the CA, certificate and key; plaintext (tls.insecure) only on loopback.
  absl::Status ValidateTls() const;
  // [tls] for node `self`: "{node}" in its paths replaced by the id.
  TlsOptions NodeTls(uint32_t self) const;
  // How node `self` reaches etcd: the etcd_* files when etcd_ca_file is set (or in plaintext with
  // tls.insecure), else the node's own [tls] files.
  etcd::TlsOptions EtcdTls(uint32_t self) const;
  int group_size() const { return data_units + parity_units; }
  // Groups of node ids, in order; node i of group g is at position i.
  std::vector<std::vector<uint32_t>> Groups() const;
  // The group and position of node `id` (nullopt when not a member).
  std::optional<std::pair<int, int>> GroupOf(uint32_t id) const;
  // Where this node listens (see listen_host).
  std::string ListenHost() const;

  // One line that two daemons of the same job print identically; Digest hashes it.
  std::string Canonical() const;
  uint64_t Digest() const;
  // Empty when the job-wide parts are equal; otherwise the first difference, e.g.
  // "parity_units: 2 here, 3 there".
  std::string DifferenceFrom(const ClusterOptions& other) const;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_CLUSTER_CONFIG_H_
