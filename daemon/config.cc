// ParseDaemonOptions over toml++: every key is read through one typed reader that records it as
// known, so anything left over is reported as unknown.
#include "daemon/config.h"

#include <fstream>
#include <set>
#include <sstream>

#include <toml++/toml.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/byte_size.h"

namespace moesnap::daemon {
namespace {

class Reader {
 public:
  Reader(const toml::table& root, std::string origin) : root_(root), origin_(std::move(origin)) {}

  absl::Status Error(const std::string& key, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(origin_, ": ", key, ": ", what));
  }

  // Looks up "table.key"; null when absent.
  const toml::node* Find(const std::string& table, const std::string& key) {
    known_.insert(table + "." + key);
    const toml::table* section = root_[table].as_table();
    return section == nullptr ? nullptr : section->get(key);
  }

  absl::Status Integer(const std::string& table, const std::string& key, int64_t minimum,
                       int64_t maximum, int64_t& out) {
    const toml::node* node = Find(table, key);
    if (node == nullptr) return absl::OkStatus();
    const auto value = node->value<int64_t>();
    if (!node->is_integer() || !value) return Error(table + "." + key, "expected an integer");
    if (*value < minimum || *value > maximum) {
      return Error(table + "." + key, absl::StrCat("must be in [", minimum, ", ", maximum,
                                                   "], got ", *value));
    }
    out = *value;
    return absl::OkStatus();
  }

  absl::Status String(const std::string& table, const std::string& key, std::string& out) {
    const toml::node* node = Find(table, key);
    if (node == nullptr) return absl::OkStatus();
    if (!node->is_string()) return Error(table + "." + key, "expected a string");
    out = *node->value<std::string>();
    return absl::OkStatus();
  }

  absl::Status Bool(const std::string& table, const std::string& key, bool& out) {
    const toml::node* node = Find(table, key);
    if (node == nullptr) return absl::OkStatus();
    if (!node->is_boolean()) return Error(table + "." + key, "expected true or false");
    out = *node->value<bool>();
    return absl::OkStatus();
  }

  absl::Status Bytes(const std::string& table, const std::string& key, uint64_t& out) {
    const toml::node* node = Find(table, key);
    if (node == nullptr) return absl::OkStatus();
    if (node->is_integer() && *node->value<int64_t>() >= 0) {
      out = static_cast<uint64_t>(*node->value<int64_t>());
      return absl::OkStatus();
    }
    if (!node->is_string()) return Error(table + "." + key, "expected a byte size such as \"4MiB\"");
    absl::StatusOr<uint64_t> bytes = ParseByteSize(*node->value<std::string>());
    if (!bytes.ok()) return Error(table + "." + key, std::string(bytes.status().message()));
    out = *bytes;
    return absl::OkStatus();
  }

  absl::Status UnknownKeys() const {
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
    if (unknown.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(origin_, ": unknown key",
                                                   unknown.size() > 1 ? "s " : " ",
                                                   absl::StrJoin(unknown, ", ")));
  }

 private:
  const toml::table& root_;
  std::string origin_;
  std::set<std::string> known_;
};

absl::StatusOr<ClusterOptions> ParseCluster(Reader& reader, uint32_t node_id) {
  ClusterOptions cluster;
  int64_t integer = cluster.data_units;
  if (absl::Status s = reader.Integer("cluster", "data_units", 1, 255, integer); !s.ok()) return s;
  cluster.data_units = static_cast<int>(integer);
  integer = cluster.parity_units;
  if (absl::Status s = reader.Integer("cluster", "parity_units", 1, 255, integer); !s.ok()) return s;
  cluster.parity_units = static_cast<int>(integer);
  if (absl::Status s = reader.Bytes("cluster", "stripe_unit_bytes", cluster.stripe_unit_bytes); !s.ok()) {
    return s;
  }
  integer = cluster.heartbeat_timeout_ms;
  if (absl::Status s = reader.Integer("cluster", "heartbeat_timeout_ms", 100, 3600000, integer); !s.ok()) {
    return s;
  }
  cluster.heartbeat_timeout_ms = static_cast<uint32_t>(integer);
  integer = cluster.commit_timeout_ms;
  if (absl::Status s = reader.Integer("cluster", "commit_timeout_ms", 100, 3600000, integer); !s.ok()) {
    return s;
  }
  cluster.commit_timeout_ms = static_cast<uint32_t>(integer);
  if (absl::Status s = reader.Bool("cluster", "allow_degraded", cluster.allow_degraded); !s.ok()) return s;

  const toml::node* nodes = reader.Find("cluster", "nodes");
  const toml::array* list = nodes == nullptr ? nullptr : nodes->as_array();
  if (list == nullptr || list->empty()) {
    return reader.Error("cluster.nodes", "a cluster needs its nodes as [[cluster.nodes]] tables");
  }
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string where = absl::StrCat("cluster.nodes[", i, "]");
    const toml::table* table = list->get(i)->as_table();
    if (table == nullptr) return reader.Error(where, "expected a table with id, host, control_port, data_port");
    ClusterNode node;
    for (const auto& [key_name, value] : *table) {
      const std::string key(key_name.str());
      const auto number = value.value<int64_t>();
      if (key == "host" && value.is_string()) {
        node.host = *value.value<std::string>();
      } else if (key == "id" && value.is_integer() && *number >= 0 && *number <= UINT32_MAX) {
        node.id = static_cast<uint32_t>(*number);
      } else if ((key == "control_port" || key == "data_port") && value.is_integer() && *number > 0 &&
                 *number < 65536) {
        (key == "control_port" ? node.control_port : node.data_port) = static_cast<uint16_t>(*number);
      } else if (key == "host" || key == "id" || key == "control_port" || key == "data_port") {
        return reader.Error(absl::StrCat(where, ".", key), "malformed value");
      } else {
        return reader.Error(absl::StrCat(where, ".", key), "unknown key");
      }
    }
    cluster.nodes.push_back(std::move(node));
  }
  if (absl::Status s = cluster.Validate(node_id); !s.ok()) {
    return reader.Error("cluster", std::string(s.message()));
  }
  return cluster;
}

absl::Status ParseDurable(Reader& reader, durable::DurableOptions& durable) {
  if (absl::Status s = reader.String("durable", "directory", durable.directory); !s.ok()) return s;
  int64_t integer = durable.every_steps;
  if (absl::Status s = reader.Integer("durable", "every_steps", 0, UINT32_MAX, integer); !s.ok()) {
    return s;
  }
  durable.every_steps = static_cast<uint32_t>(integer);
  integer = durable.every_seconds;
  if (absl::Status s = reader.Integer("durable", "every_seconds", 0, 31 * 24 * 3600, integer);
      !s.ok()) {
    return s;
  }
  durable.every_seconds = static_cast<uint32_t>(integer);
  integer = durable.keep;
  if (absl::Status s = reader.Integer("durable", "keep", 1, 1000, integer); !s.ok()) return s;
  durable.keep = static_cast<uint32_t>(integer);
  if (absl::Status s = reader.Bytes("durable", "bytes_per_second", durable.bytes_per_second);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = durable.Validate(); !s.ok()) {
    return reader.Error("durable", std::string(s.message()));
  }
  return absl::OkStatus();
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
  int64_t integer = 0;
  std::string text_value;

  integer = options.node_id;
  if (absl::Status s = reader.Integer("node", "id", 0, UINT32_MAX, integer); !s.ok()) return s;
  options.node_id = static_cast<uint32_t>(integer);
  if (absl::Status s = reader.String("agent", "socket", options.agent_socket); !s.ok()) return s;
  if (absl::Status s = reader.String("admin", "socket", options.admin_socket); !s.ok()) return s;
  if (options.agent_socket.empty() || options.admin_socket.empty()) {
    return reader.Error("agent.socket/admin.socket", "a socket path must not be empty");
  }
  if (options.agent_socket == options.admin_socket) {
    return reader.Error("admin.socket", "must differ from agent.socket");
  }

  if (absl::Status s = reader.String("access", "group", options.access.group); !s.ok()) return s;
  if (const toml::node* uids = reader.Find("access", "allowed_uids")) {
    const toml::array* list = uids->as_array();
    if (list == nullptr) return reader.Error("access.allowed_uids", "expected an array of uids");
    for (const toml::node& uid : *list) {
      if (!uid.is_integer() || *uid.value<int64_t>() < 0) {
        return reader.Error("access.allowed_uids", "every entry must be a non-negative integer");
      }
      options.access.allowed_uids.push_back(static_cast<uid_t>(*uid.value<int64_t>()));
    }
  }

  if (absl::Status s = reader.String("pool", "name", options.pool.name); !s.ok()) return s;
  if (absl::Status s = reader.Bytes("pool", "bytes", options.pool.bytes); !s.ok()) return s;
  if (absl::Status s = reader.Bytes("pool", "journal_bytes", options.pool.journal_bytes); !s.ok()) {
    return s;
  }
  text_value = "auto";
  if (absl::Status s = reader.String("pool", "lock", text_value); !s.ok()) return s;
  if (text_value == "auto") {
    options.pool.lock = PoolLockMode::kAuto;
  } else if (text_value == "required") {
    options.pool.lock = PoolLockMode::kRequired;
  } else if (text_value == "off") {
    options.pool.lock = PoolLockMode::kOff;
  } else {
    return reader.Error("pool.lock", absl::StrCat("must be auto, required or off, got '",
                                                  text_value, "'"));
  }

  integer = options.capture.threads;
  if (absl::Status s = reader.Integer("capture", "threads", 1, 256, integer); !s.ok()) return s;
  options.capture.threads = static_cast<int>(integer);
  if (absl::Status s = reader.Bytes("capture", "chunk_bytes", options.capture.chunk_bytes); !s.ok()) {
    return s;
  }

  if (absl::Status s = reader.Bytes("upstream_log", "max_bytes", options.upstream_log.max_bytes);
      !s.ok()) {
    return s;
  }
  if (options.upstream_log.max_bytes == 0) {
    return reader.Error("upstream_log.max_bytes", "must be positive");
  }

  if (absl::Status s = ParseDurable(reader, options.durable); !s.ok()) return s;

  text_value = "info";
  if (absl::Status s = reader.String("log", "level", text_value); !s.ok()) return s;
  absl::StatusOr<LogLevel> level = ParseLogLevel(text_value);
  if (!level.ok()) return reader.Error("log.level", std::string(level.status().message()));
  options.log_level = *level;

  if (root.contains("cluster")) {
    absl::StatusOr<ClusterOptions> cluster = ParseCluster(reader, options.node_id);
    if (!cluster.ok()) return cluster.status();
    options.cluster = *std::move(cluster);
  }

  if (absl::Status s = reader.UnknownKeys(); !s.ok()) return s;
  return options;
}

absl::StatusOr<DaemonOptions> LoadDaemonOptions(const std::string& path) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  std::stringstream text;
  text << file.rdbuf();
  return ParseDaemonOptions(text.str(), path);
}

}  // namespace moesnap::daemon
