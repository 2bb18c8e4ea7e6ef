// ParseDaemonOptions over toml++: every key is read through one typed reader that records it as
// known, so anything left over is reported as unknown. Errors are collected, not returned at the
// first: an operator fixes a config in one pass, and nothing is created before all of it is valid.
#include "daemon/config.h"

#include <sys/un.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include <toml++/toml.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/byte_size.h"
#include "common/memory_handoff_wire.h"
#include "daemon/journal.h"

namespace moesnap::daemon {
namespace {

class Reader {
 public:
  Reader(const toml::table& root, std::string origin) : root_(root), origin_(std::move(origin)) {}

  void Error(const std::string& key, const std::string& what) {
    errors_.push_back(absl::StrCat(origin_, ": ", key, ": ", what));
  }

  // Looks up "table.key"; null when absent.
  const toml::node* Find(const std::string& table, const std::string& key) {
    known_.insert(table + "." + key);
    const toml::table* section = root_[table].as_table();
    return section == nullptr ? nullptr : section->get(key);
  }

  void Integer(const std::string& table, const std::string& key, int64_t minimum, int64_t maximum,
               int64_t& out) {
    const toml::node* node = Find(table, key);
    if (node == nullptr) return;
    // Exactly an integer: value<int64_t>() would convert a float, out of range undefined.
    const std::optional<int64_t> value = node->value_exact<int64_t>();
    if (!value) return Error(table + "." + key, "expected an integer");
    if (*value < minimum || *value > maximum) {
      return Error(table + "." + key,
                   absl::StrCat("must be in [", minimum, ", ", maximum, "], got ", *value));
    }
    out = *value;
  }

  // An integer key of a narrower type, range-checked before it is narrowed.
  template <typename T>
  void Integer(const std::string& table, const std::string& key, int64_t minimum, int64_t maximum,
               T& out) {
    int64_t value = static_cast<int64_t>(out);
    Integer(table, key, minimum, maximum, value);
    out = static_cast<T>(value);
  }

  void String(const std::string& table, const std::string& key, std::string& out) {
    const toml::node* node = Find(table, key);
    if (node == nullptr) return;
    if (!node->is_string()) return Error(table + "." + key, "expected a string");
    out = *node->value<std::string>();
  }

  void Strings(const std::string& table, const std::string& key, std::vector<std::string>& out) {
    const toml::node* node = Find(table, key);
    if (node == nullptr) return;
    const toml::array* list = node->as_array();
    std::vector<std::string> values;
    for (size_t i = 0; list != nullptr && i < list->size(); ++i) {
      if (!list->get(i)->is_string()) {
        list = nullptr;
        break;
      }
      values.push_back(*list->get(i)->value<std::string>());
    }
    if (list == nullptr) return Error(table + "." + key, "expected an array of strings");
    out = std::move(values);
  }

  void Bool(const std::string& table, const std::string& key, bool& out) {
    const toml::node* node = Find(table, key);
    if (node == nullptr) return;
    if (!node->is_boolean()) return Error(table + "." + key, "expected true or false");
    out = *node->value<bool>();
  }

  void Bytes(const std::string& table, const std::string& key, uint64_t& out) {
    const toml::node* node = Find(table, key);
    if (node == nullptr) return;
    if (const std::optional<int64_t> count = node->value_exact<int64_t>(); count && *count >= 0) {
      out = static_cast<uint64_t>(*count);
      return;
    }
    if (!node->is_string()) return Error(table + "." + key, "expected a byte size such as \"4MiB\"");
    absl::StatusOr<uint64_t> bytes = ParseByteSize(*node->value<std::string>());
    if (!bytes.ok()) return Error(table + "." + key, std::string(bytes.status().message()));
    out = *bytes;
  }

  void UnknownKeys() {
    std::vector<std::string> unknown;
    for (const auto& [table_name, table_node] : root_) {
      const std::string table(table_name.str());
      const toml::table* section = table_node.as_table();
      if (section == nullptr) {
        unknown.push_back(table);
        continue;
      }
      for (const auto& [key, value] : *section) {
        const std::string full = absl::StrCat(table, ".", std::string(key.str()));
        if (!known_.contains(full)) unknown.push_back(full);
      }
    }
    if (unknown.empty()) return;
    errors_.push_back(absl::StrCat(origin_, ": unknown key", unknown.size() > 1 ? "s " : " ",
                                   absl::StrJoin(unknown, ", ")));
  }

  // Every error, one per line, or OK.
  absl::Status Result() const {
    if (errors_.empty()) return absl::OkStatus();
    if (errors_.size() == 1) return absl::InvalidArgumentError(errors_.front());
    return absl::InvalidArgumentError(absl::StrCat(errors_.size(), " errors in ", origin_, ":\n",
                                                   absl::StrJoin(errors_, "\n")));
  }

 private:
  const toml::table& root_;
  std::string origin_;
  std::set<std::string> known_;
  std::vector<std::string> errors_;
};

void CheckSocketPath(Reader& reader, const std::string& key, const std::string& path) {
  if (path.empty()) return reader.Error(key, "a socket path must not be empty");
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    reader.Error(key, absl::StrCat("a Unix socket path holds at most ",
                                   sizeof(sockaddr_un::sun_path) - 1, " bytes, '", path, "' has ",
                                   path.size()));
  }
}

std::optional<ClusterOptions> ParseCluster(Reader& reader) {
  ClusterOptions cluster;
  reader.String("cluster", "job", cluster.job);
  reader.Integer("cluster", "node_count", 1, 65536, cluster.node_count);
  reader.Integer("cluster", "data_units", 1, 255, cluster.data_units);
  reader.Integer("cluster", "parity_units", 1, 255, cluster.parity_units);
  reader.Bytes("cluster", "stripe_unit_bytes", cluster.stripe_unit_bytes);
  reader.Integer("cluster", "lease_ttl_ms", 2000, 3600000, cluster.lease_ttl_ms);
  reader.Integer("cluster", "commit_timeout_ms", 100, 3600000, cluster.commit_timeout_ms);
  reader.Bool("cluster", "allow_degraded", cluster.allow_degraded);
  reader.Strings("cluster", "etcd_endpoints", cluster.etcd_endpoints);
  reader.String("cluster", "etcd_ca_file", cluster.etcd_ca_file);
  reader.String("cluster", "etcd_cert_file", cluster.etcd_cert_file);
  reader.String("cluster", "etcd_key_file", cluster.etcd_key_file);
  reader.String("cluster", "advertise_host", cluster.advertise_host);
  reader.String("cluster", "listen_host", cluster.listen_host);
  reader.Integer("cluster", "control_port", 0, 65535, cluster.control_port);
  reader.Integer("cluster", "data_port", 0, 65535, cluster.data_port);
  reader.Integer("cluster", "max_data_connections", 1, 65536, cluster.max_data_connections);
  reader.Bytes("cluster", "restore_buffer_bytes", cluster.restore_buffer_bytes);
  if (cluster.restore_buffer_bytes < ClusterOptions::kMinRestoreBufferBytes) {
    reader.Error("cluster.restore_buffer_bytes",
                 absl::StrCat("must be at least ", ClusterOptions::kMinRestoreBufferBytes,
                              " bytes, got ", cluster.restore_buffer_bytes));
  }
  if (reader.Find("cluster", "nodes") != nullptr) {
    reader.Error("cluster.nodes", "nodes are no longer listed: each daemon finds its peers in etcd; "
                                  "set cluster.node_count and this node's cluster.advertise_host");
    return std::nullopt;
  }
  if (cluster.node_count == 0) {
    reader.Error("cluster.node_count", "a cluster needs the number of nodes of the job");
    return std::nullopt;
  }
  // This node's id and address may still come from the command line or the environment
  // (ApplyNodeIdentity checks them); the job's shape must hold now.
  if (absl::Status s = cluster.ValidateShape(); !s.ok()) {
    reader.Error("cluster", std::string(s.message()));
    return std::nullopt;
  }
  return cluster;
}

void ParseTls(Reader& reader, TlsOptions& tls) {
  reader.String("tls", "ca_file", tls.ca_file);
  reader.String("tls", "cert_file", tls.cert_file);
  reader.String("tls", "key_file", tls.key_file);
  reader.Bool("tls", "insecure", tls.insecure);
}

void ParseDurable(Reader& reader, durable::DurableOptions& durable) {
  reader.String("durable", "directory", durable.directory);
  reader.Integer("durable", "every_steps", 0, UINT32_MAX, durable.every_steps);
  reader.Integer("durable", "every_seconds", 0, 31 * 24 * 3600, durable.every_seconds);
  reader.Integer("durable", "keep", 1, 1000, durable.keep);
  reader.Bytes("durable", "bytes_per_second", durable.bytes_per_second);
  if (absl::Status status = durable.Validate(); !status.ok()) {
    reader.Error("durable", std::string(status.message()));
  }
}

}  // namespace

absl::StatusOr<DaemonOptions> ParseDaemonOptions(const std::string& text, const std::string& origin) {
  toml::table root;
  try {
    root = toml::parse(text, origin);
  } catch (const toml::parse_error& error) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ":", error.source().begin.line, ":",
                                                   error.source().begin.column, ": ",
                                                   std::string(error.description())));
  }
  Reader reader(root, origin);
  DaemonOptions options;

  reader.Integer("node", "id", 0, UINT32_MAX, options.node_id);
  reader.String("agent", "socket", options.agent_socket);
  reader.String("admin", "socket", options.admin_socket);
  reader.String("admin", "group", options.admin_access.group);
  CheckSocketPath(reader, "agent.socket", options.agent_socket);
  // Trainers hand over their memory on the agent socket's path + ".memory": it must fit too.
  CheckSocketPath(reader, "agent.socket",
                  options.agent_socket + memory_handoff::kSocketSuffix);
  CheckSocketPath(reader, "admin.socket", options.admin_socket);
  if (options.agent_socket == options.admin_socket) {
    reader.Error("admin.socket", "must differ from agent.socket");
  }

  // At least two: gRPC keeps one thread waiting for the next call whatever the cap (and aborts
  // the process when the cap leaves it none), so the rest serve calls. At most 65,536: a typo
  // must not mean no cap.
  reader.Integer("agent", "max_threads", 2, 65536, options.agent_max_threads);

  int64_t retention_seconds = absl::ToInt64Seconds(options.exited_trainer_memory_retention);
  reader.Integer("agent", "exited_trainer_memory_seconds", 0, 24 * 3600, retention_seconds);
  options.exited_trainer_memory_retention = absl::Seconds(retention_seconds);
  if (reader.Find("agent", "exited_trainer_memory_max_bytes") != nullptr) {
    uint64_t max_bytes = 0;
    reader.Bytes("agent", "exited_trainer_memory_max_bytes", max_bytes);
    options.exited_trainer_memory_max_bytes = max_bytes;
  }

  reader.String("access", "group", options.access.group);
  if (const toml::node* uids = reader.Find("access", "allowed_uids")) {
    const toml::array* list = uids->as_array();
    if (list == nullptr) {
      reader.Error("access.allowed_uids", "expected an array of uids");
    } else {
      for (const toml::node& uid : *list) {
        if (!uid.is_integer() || *uid.value<int64_t>() < 0 || *uid.value<int64_t>() > UINT32_MAX) {
          reader.Error("access.allowed_uids", "every entry must be a non-negative integer");
          break;
        }
        options.access.allowed_uids.push_back(static_cast<uid_t>(*uid.value<int64_t>()));
      }
    }
  }

  reader.String("pool", "name", options.pool.name);
  if (options.pool.name.empty() || options.pool.name.size() > 190 ||
      options.pool.name.find('/') != std::string::npos) {
    reader.Error("pool.name", absl::StrCat("must be 1-190 characters without '/', got '",
                                           options.pool.name, "'"));
  }
  reader.Bytes("pool", "bytes", options.pool.bytes);
  if (options.pool.bytes < Pool::kPageBytes || options.pool.bytes % Pool::kPageBytes != 0) {
    reader.Error("pool.bytes", absl::StrCat("must be a positive multiple of ", Pool::kPageBytes,
                                            " bytes, got ", options.pool.bytes));
  }
  reader.Bytes("pool", "journal_bytes", options.pool.journal_bytes);
  if (options.pool.journal_bytes < Journal::kMinimumBytes) {
    reader.Error("pool.journal_bytes", absl::StrCat("must be at least ", Journal::kMinimumBytes,
                                                    " bytes, got ", options.pool.journal_bytes));
  }
  std::string lock = "auto";
  reader.String("pool", "lock", lock);
  if (lock == "auto") {
    options.pool.lock = PoolLockMode::kAuto;
  } else if (lock == "required") {
    options.pool.lock = PoolLockMode::kRequired;
  } else if (lock == "off") {
    options.pool.lock = PoolLockMode::kOff;
  } else {
    reader.Error("pool.lock", absl::StrCat("must be auto, required or off, got '", lock, "'"));
  }

  reader.Integer("capture", "threads", 1, 256, options.capture.threads);
  reader.Integer("capture", "max_in_flight_steps", 0, 64, options.capture.max_in_flight_steps);
  int64_t idle_rank_timeout_ms = absl::ToInt64Milliseconds(options.capture.idle_rank_timeout);
  reader.Integer("capture", "idle_rank_timeout_ms", 0, 7 * 24 * 3600 * 1000, idle_rank_timeout_ms);
  options.capture.idle_rank_timeout = absl::Milliseconds(idle_rank_timeout_ms);
  reader.Bool("capture", "parity_only", options.capture.parity_only);
  reader.Bytes("capture", "chunk_bytes", options.capture.chunk_bytes);
  if (options.capture.chunk_bytes < 4096 || options.capture.chunk_bytes > (uint64_t{1} << 30)) {
    reader.Error("capture.chunk_bytes", absl::StrCat("must be in [4 KiB, 1 GiB], got ",
                                                     options.capture.chunk_bytes));
  }

  reader.Bytes("upstream_log", "max_bytes", options.upstream_log.max_bytes);
  if (options.upstream_log.max_bytes == 0) {
    reader.Error("upstream_log.max_bytes", "must be positive");
  }

  reader.String("http", "address", options.http.address);
  if (!options.http.address.empty()) {
    if (absl::Status parsed = ParseHttpAddress(options.http.address).status(); !parsed.ok()) {
      reader.Error("http.address", std::string(parsed.message()));
    }
  }
  ParseDurable(reader, options.durable);

  std::string level = "info";
  reader.String("log", "level", level);
  if (absl::StatusOr<LogLevel> parsed = ParseLogLevel(level); parsed.ok()) {
    options.log_level = *parsed;
  } else {
    reader.Error("log.level", std::string(parsed.status().message()));
  }
  std::string format = "text";
  reader.String("log", "format", format);
  if (absl::StatusOr<LogFormat> parsed = ParseLogFormat(format); parsed.ok()) {
    options.log_format = *parsed;
  } else {
    reader.Error("log.format", std::string(parsed.status().message()));
  }

  if (root.contains("cluster")) {
    options.cluster = ParseCluster(reader);
    if (options.cluster) ParseTls(reader, options.cluster->tls);
  } else if (root.contains("tls")) {
    reader.Error("tls", "[tls] authenticates a cluster's peers, and this config has no [cluster]");
  }

  reader.UnknownKeys();
  if (absl::Status errors = reader.Result(); !errors.ok()) return errors;
  return options;
}

absl::StatusOr<NodeIdentity> NodeIdentityFromEnvironment() {
  NodeIdentity identity;
  if (const char* id = std::getenv("MOESNAP_NODE_ID"); id != nullptr && *id != '\0') {
    uint32_t value = 0;
    if (!absl::SimpleAtoi(id, &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("MOESNAP_NODE_ID: expected a node id (an integer >= 0), got '", id, "'"));
    }
    identity.node_id = value;
  }
  if (const char* host = std::getenv("MOESNAP_ADVERTISE_HOST"); host != nullptr && *host != '\0') {
    identity.advertise_host = host;
  }
  return identity;
}

absl::Status ApplyNodeIdentity(const NodeIdentity& identity, DaemonOptions* options) {
  if (identity.node_id) options->node_id = *identity.node_id;
  if (!options->cluster) return absl::OkStatus();
  if (identity.advertise_host) options->cluster->advertise_host = *identity.advertise_host;
  return options->cluster->Validate(options->node_id);
}

absl::StatusOr<DaemonOptions> LoadDaemonOptions(const std::string& path) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  std::stringstream text;
  text << file.rdbuf();
  return ParseDaemonOptions(text.str(), path);
}

}  // namespace moesnap::daemon
