// ParseDaemonOptions: defaults, every key, and errors that name the key and the file.
#include "daemon/config.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "common/byte_size.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

TEST(ConfigTest, EmptyFileTakesEveryDefault) {
  absl::StatusOr<DaemonOptions> options = ParseDaemonOptions("", "empty.toml");
  ASSERT_OK(options);
  EXPECT_EQ(options->agent_socket, "/run/moesnap/agent.sock");
  EXPECT_EQ(options->pool.bytes, uint64_t{8} << 30);
  EXPECT_EQ(options->capture.chunk_bytes, uint64_t{4} << 20);
  EXPECT_EQ(options->capture.max_in_flight_steps, 0);
  EXPECT_EQ(options->pool.lock, PoolLockMode::kAuto);
  EXPECT_EQ(options->upstream_log.max_bytes, uint64_t{1} << 30);
  EXPECT_EQ(options->exited_trainer_memory_max_bytes, std::nullopt);  // half the host's memory
  EXPECT_EQ(options->agent_max_threads, kDefaultAgentMaxThreads);
}

TEST(ConfigTest, ReadsEveryKey) {
  absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(R"(
[node]
id = 7
[agent]
socket = "/tmp/a.sock"
exited_trainer_memory_max_bytes = "64GiB"
max_threads = 300
[admin]
socket = "/tmp/b.sock"
group = "operators"
[access]
group = "moesnap"
allowed_uids = [1000, 1001]
[pool]
name = "p"
bytes = "2GiB"
lock = "required"
journal_bytes = 1048576
[capture]
threads = 4
chunk_bytes = "1 MiB"
max_in_flight_steps = 3
idle_rank_timeout_ms = 5000
parity_only = true
[upstream_log]
max_bytes = "256MiB"
[http]
address = "[::1]:9100"
[durable]
directory = "/var/lib/moesnap/durable"
every_steps = 100
every_seconds = 600
keep = 3
bytes_per_second = "500MiB"
[log]
level = "debug"
format = "json"
)", "full.toml");
  ASSERT_OK(options);
  EXPECT_EQ(options->node_id, 7u);
  EXPECT_EQ(options->admin_socket, "/tmp/b.sock");
  EXPECT_EQ(options->exited_trainer_memory_max_bytes, uint64_t{64} << 30);
  EXPECT_EQ(options->agent_max_threads, 300);
  EXPECT_EQ(options->access.group, "moesnap");
  EXPECT_EQ(options->access.allowed_uids, (std::vector<uid_t>{1000, 1001}));
  EXPECT_EQ(options->admin_access.group, "operators");
  EXPECT_TRUE(options->admin_access.allowed_uids.empty());
  EXPECT_EQ(options->pool.bytes, uint64_t{2} << 30);
  EXPECT_EQ(options->pool.lock, PoolLockMode::kRequired);
  EXPECT_EQ(options->pool.journal_bytes, 1048576u);
  EXPECT_EQ(options->capture.threads, 4);
  EXPECT_EQ(options->capture.chunk_bytes, 1u << 20);
  EXPECT_EQ(options->capture.max_in_flight_steps, 3);
  EXPECT_EQ(options->capture.idle_rank_timeout, absl::Seconds(5));
  EXPECT_TRUE(options->capture.parity_only);
  EXPECT_EQ(options->upstream_log.max_bytes, uint64_t{256} << 20);
  EXPECT_EQ(options->durable.directory, "/var/lib/moesnap/durable");
  EXPECT_EQ(options->durable.every_steps, 100u);
  EXPECT_EQ(options->durable.every_seconds, 600u);
  EXPECT_EQ(options->durable.keep, 3u);
  EXPECT_EQ(options->durable.bytes_per_second, uint64_t{500} << 20);
  EXPECT_EQ(options->log_level, LogLevel::kDebug);
  EXPECT_EQ(options->http.address, "[::1]:9100");
  EXPECT_EQ(options->log_format, LogFormat::kJson);
}

TEST(ConfigTest, ErrorsNameTheKeyAndTheFile) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[pool]\nbytes = \"8 GB\"\n", "site.toml: pool.bytes"},
      {"[pool]\nlock = \"maybe\"\n", "site.toml: pool.lock"},
      {"[node]\nid = -1\n", "site.toml: node.id"},
      {"[node]\nid = \"zero\"\n", "site.toml: node.id: expected an integer"},
      // A float past any integer: refused, never converted (undefined beyond int64's range).
      {"[node]\nid = 74e41\n", "site.toml: node.id: expected an integer"},
      {"[pool]\nbytes = 1.5e30\n", "site.toml: pool.bytes: expected a byte size"},
      {"[capture]\nthreads = 1000\n", "site.toml: capture.threads"},
      {"[upstream_log]\nmax_bytes = 0\n", "site.toml: upstream_log.max_bytes: must be positive"},
      {"[log]\nlevel = \"loud\"\n", "site.toml: log.level"},
      {"[log]\nformat = \"xml\"\n", "site.toml: log.format: log format 'xml' is not text or json"},
      {"[http]\naddress = \"localhost:7442\"\n", "site.toml: http.address: expected an IP address"},
      {"[durable]\ndirectory = \"/d\"\n", "site.toml: durable: a directory needs every_steps or every_seconds"},
      {"[durable]\ndirectory = \"relative\"\nevery_steps = 2\n", "site.toml: durable: directory must be an absolute path"},
      {"[durable]\nkeep = 0\n", "site.toml: durable.keep"},
      {"[durable]\nevery_steps = -2\n", "site.toml: durable.every_steps"},
      {"[durable]\nbytes_per_second = \"fast\"\n", "site.toml: durable.bytes_per_second"},
      {"[agent]\nexited_trainer_memory_max_bytes = -1\n",
       "site.toml: agent.exited_trainer_memory_max_bytes"},
      // gRPC keeps one of the threads polling: one thread would serve no call.
      {"[agent]\nmax_threads = 1\n", "site.toml: agent.max_threads: must be in [2, 65536], got 1"},
      {"[agent]\nmax_threads = 100000\n", "site.toml: agent.max_threads: must be in [2, 65536]"},
      {"[agent]\nmax_threads = \"many\"\n", "site.toml: agent.max_threads: expected an integer"},
      {"[durable]\nevery = 2\n", "unknown key durable.every"},
      {"[access]\nallowed_uids = [-3]\n", "site.toml: access.allowed_uids"},
      {"[pool]\nname = \"p\"\ncolor = \"red\"\n[extra]\nx = 1\n", "unknown keys extra.x, pool.color"},
      {"[agent]\nsocket = \"/x\"\n[admin]\nsocket = \"/x\"\n", "admin.socket"},
      {"pool = 3\n", "unknown key pool"},
      {"[pool\n", "site.toml:1:"},
  };
  for (const auto& [text, mentions] : cases) {
    absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(text, "site.toml");
    ASSERT_STATUS(options, absl::StatusCode::kInvalidArgument) << text;
    EXPECT_TRUE(absl::StrContains(options.status().message(), mentions))
        << options.status() << " should mention " << mentions;
  }
}

// Every error of a file is reported at once, each naming its key, so one edit fixes them all.
TEST(ConfigTest, ListsEveryErrorNotOnlyTheFirst) {
  absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(R"(
[pool]
bytes = "1000"
journal_bytes = "1KiB"
lock = "maybe"
[capture]
chunk_bytes = "1KiB"
threads = 0
[log]
level = "loud"
[stray]
x = 1
)", "site.toml");
  ASSERT_STATUS(options, absl::StatusCode::kInvalidArgument);
  const std::string message(options.status().message());
  EXPECT_TRUE(absl::StartsWith(message, "7 errors in site.toml:\n")) << message;
  for (const char* mentions :
       {"site.toml: pool.bytes: must be a positive multiple of 4096 bytes, got 1000",
        "site.toml: pool.journal_bytes: must be at least 65536", "site.toml: pool.lock",
        "site.toml: capture.chunk_bytes", "site.toml: capture.threads", "site.toml: log.level",
        "site.toml: unknown key stray.x"}) {
    EXPECT_TRUE(absl::StrContains(message, mentions)) << message << "\nshould mention " << mentions;
  }
}

// What used to fail only once the daemon ran (after the pool was created) is refused here.
TEST(ConfigTest, RefusesWhatWouldFailAfterThePoolIsCreated) {
  const std::string cluster = "[cluster]\nnode_count = 3\ndata_units = 1\nparity_units = 1\n";
  absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(
      "[agent]\nsocket = \"/run/" + std::string(120, 'a') + "\"\n" + cluster, "site.toml");
  ASSERT_STATUS(options, absl::StatusCode::kInvalidArgument);
  const std::string message(options.status().message());
  EXPECT_TRUE(absl::StrContains(message, "3 nodes cannot form groups of k + m = 2")) << message;
  EXPECT_TRUE(absl::StrContains(message, "site.toml: agent.socket: a Unix socket path holds at most"))
      << message;
  EXPECT_OK(ParseDaemonOptions(absl::StrReplaceAll(cluster, {{"= 3", "= 4"}}), "site.toml"));
}

TEST(ByteSizeTest, ParsesUnitsAndRejectsAmbiguity) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("4KiB"), 4096u);
  EXPECT_EQ(*ParseByteSize(" 3 MiB "), 3u << 20);
  EXPECT_EQ(*ParseByteSize("1TiB"), uint64_t{1} << 40);
  EXPECT_EQ(*ParseByteSize("12B"), 12u);
  for (const char* bad : {"", "MiB", "4MB", "-4KiB", "1.5GiB", "99999999999999999999", "16777216TiB"}) {
    EXPECT_STATUS(ParseByteSize(bad), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(FormatByteSize(256u << 20), "256.0 MiB");
  EXPECT_EQ(FormatByteSize(12), "12 B");
}

}  // namespace
}  // namespace moesnap::daemon

namespace moesnap::daemon {
namespace {

// The documented example must load, and document exactly the defaults.
TEST(ConfigTest, ExampleConfigLoadsWithTheDefaults) {
  absl::StatusOr<DaemonOptions> example =
      LoadDaemonOptions(std::string(MOESNAP_SOURCE_DIR) + "/deploy/moesnapd.toml");
  ASSERT_OK(example);
  const DaemonOptions defaults;
  EXPECT_EQ(example->agent_socket, defaults.agent_socket);
  EXPECT_EQ(example->admin_socket, defaults.admin_socket);
  EXPECT_EQ(example->agent_max_threads, defaults.agent_max_threads);
  EXPECT_EQ(example->pool.name, defaults.pool.name);
  EXPECT_EQ(example->pool.bytes, defaults.pool.bytes);
  EXPECT_EQ(example->pool.journal_bytes, defaults.pool.journal_bytes);
  EXPECT_EQ(example->pool.lock, defaults.pool.lock);
  EXPECT_EQ(example->capture.threads, defaults.capture.threads);
  EXPECT_EQ(example->capture.chunk_bytes, defaults.capture.chunk_bytes);
  EXPECT_EQ(example->durable.directory, defaults.durable.directory);
  EXPECT_EQ(example->durable.every_steps, defaults.durable.every_steps);
  EXPECT_EQ(example->durable.every_seconds, defaults.durable.every_seconds);
  EXPECT_EQ(example->durable.keep, defaults.durable.keep);
  EXPECT_EQ(example->durable.bytes_per_second, defaults.durable.bytes_per_second);
  EXPECT_EQ(example->log_level, defaults.log_level);
  EXPECT_EQ(example->http.address, defaults.http.address);
  EXPECT_EQ(example->log_format, defaults.log_format);
}

}  // namespace
}  // namespace moesnap::daemon
