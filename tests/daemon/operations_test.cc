// Operating a real moesnapd: Debian's Prometheus server scrapes it and agrees with `moesnapctl
// status`; promtool accepts the exposition; /healthz, /readyz and the gRPC health service on both
// sockets answer; systemd's notify protocol (READY=1, WATCHDOG=1 only while the daemon answers its
// own probe, STOPPING=1) over a NOTIFY_SOCKET the test listens on.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/loopback_port.h"
#include "moesnap/client.h"
#include "tests/testing/child_process.h"
#include "tests/testing/http_client.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;
using testing::BinaryPath;
using testing::ChildProcess;
using testing::HttpGet;
using testing::TestDaemon;
using namespace std::chrono_literals;

// Polls `condition` every 20 ms until it holds or `timeout` passes.
template <typename Condition>
bool Eventually(Condition condition, absl::Duration timeout = absl::Seconds(60)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return condition();
}

absl::StatusOr<Struct> ParseJson(const std::string& text) {
  Struct parsed;
  if (!google::protobuf::util::JsonStringToMessage(text, &parsed).ok()) {
    return absl::InvalidArgumentError("not JSON: " + text);
  }
  return parsed;
}

std::string UrlEncode(const std::string& text) {
  std::string out;
  for (const unsigned char c : text) {
    if (std::isalnum(c) || c == '_' || c == '-' || c == '.') {
      out += static_cast<char>(c);
    } else {
      out += absl::StrFormat("%%%02X", c);
    }
  }
  return out;
}

// A daemon holding one committed step of 1 MiB from rank 3.
class OperationsTest : public ::testing::Test {
 protected:
  void CommitOneStep(TestDaemon& daemon) {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.socket_path = daemon.agent_socket(), .rank = 3});
    ASSERT_OK(client);
    absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = (*client)->AllocateHost(1 << 20);
    ASSERT_OK(buffer);
    std::memset((*buffer)->data(), 0x5a, 1 << 20);
    ASSERT_OK((*client)->RegisterHostRegion({"weights", "uint8", {1 << 20}}, *buffer, 0, 1 << 20));
    ASSERT_OK((*client)->Snapshot(7));
    ASSERT_OK((*client)->WaitCommitted(7));
  }
};

// The value of an instant query with one result, or nullopt while Prometheus has none.
std::optional<double> QueryPrometheus(uint16_t port, const std::string& query) {
  absl::StatusOr<testing::HttpReply> reply =
      HttpGet(port, "/api/v1/query?query=" + UrlEncode(query), 5s);
  if (!reply.ok() || reply->status != 200) return std::nullopt;
  absl::StatusOr<Struct> parsed = ParseJson(reply->body);
  if (!parsed.ok()) return std::nullopt;
  const auto& result = parsed->fields().at("data").struct_value().fields().at("result").list_value();
  if (result.values_size() != 1) return std::nullopt;
  const auto& sample = result.values(0).struct_value().fields().at("value").list_value();
  double value = 0;
  if (sample.values_size() != 2 || !absl::SimpleAtod(sample.values(1).string_value(), &value)) {
    return std::nullopt;
  }
  return value;
}

TEST_F(OperationsTest, PrometheusScrapesTheDaemonAndAgreesWithMoesnapctl) {
  TestDaemon daemon({.pool_bytes = "64MiB"});
  ASSERT_TRUE(daemon.Start());
  ASSERT_NO_FATAL_FAILURE(CommitOneStep(daemon));

  const std::string directory = daemon.directory() + "/prometheus";
  std::filesystem::create_directories(directory);
  std::ofstream(directory + "/prometheus.yml") << absl::StrCat(
      "global:\n  scrape_interval: 250ms\n  scrape_timeout: 200ms\n"
      "scrape_configs:\n  - job_name: moesnapd\n    static_configs:\n"
      "      - targets: ['127.0.0.1:", daemon.http_port(), "']\n");
  const uint16_t prometheus_port = UnusedLoopbackPort();
  ASSERT_TRUE(std::filesystem::exists("/usr/bin/prometheus"))
      << "Debian's prometheus package is missing: run deploy/install-deps.sh";
  ChildProcess prometheus({"/usr/bin/prometheus", "--config.file=" + directory + "/prometheus.yml",
                           "--storage.tsdb.path=" + directory + "/data",
                           absl::StrCat("--web.listen-address=127.0.0.1:", prometheus_port),
                           "--log.level=warn"});
  // A scrape has landed once `up` is 1 and the daemon's series are queryable.
  ASSERT_TRUE(Eventually([&] {
    return QueryPrometheus(prometheus_port, "up{job=\"moesnapd\"}") == 1.0 &&
           QueryPrometheus(prometheus_port, "moesnap_pool_used_bytes").has_value();
  })) << "Prometheus never scraped the daemon";

  ChildProcess ctl({BinaryPath("moesnapctl"), "status", "--json", "--socket", daemon.admin_socket()});
  const std::optional<std::string> line = ctl.ReadLine(30s);
  ASSERT_TRUE(line.has_value());
  ASSERT_EQ(ctl.Wait(30s), 0);
  absl::StatusOr<Struct> status = ParseJson(*line);
  ASSERT_OK(status);
  const auto& fields = status->fields();
  for (const auto& [metric, field] : std::vector<std::pair<std::string, std::string>>{
           {"moesnap_pool_capacity_bytes", "pool_bytes"},
           {"moesnap_pool_used_bytes", "pool_used_bytes"},
           {"moesnap_pool_in_flight_bytes", "pool_in_flight_bytes"},
           {"moesnap_ranks", "ranks"},
           {"moesnap_journal_sequence", "journal_sequence"}}) {
    EXPECT_EQ(QueryPrometheus(prometheus_port, metric), fields.at(field).number_value()) << metric;
  }
  EXPECT_EQ(fields.at("pool_used_bytes").number_value(), 1 << 20);
  EXPECT_EQ(QueryPrometheus(prometheus_port, "moesnap_pool_free_bytes"),
            fields.at("pool_bytes").number_value() - fields.at("pool_used_bytes").number_value());
  EXPECT_EQ(QueryPrometheus(prometheus_port, "moesnap_snapshot_bytes_total"), 1 << 20);
  EXPECT_EQ(QueryPrometheus(prometheus_port, "moesnap_steps_total{outcome=\"committed\"}"), 1);
  EXPECT_EQ(QueryPrometheus(prometheus_port, "moesnap_steps_total{outcome=\"aborted\"}"), 0);
  EXPECT_EQ(QueryPrometheus(prometheus_port, "moesnap_capture_duration_seconds_count"), 1);
  EXPECT_EQ(QueryPrometheus(prometheus_port, "moesnap_snapshot_blocking_seconds_count"), 1);
  EXPECT_GE(QueryPrometheus(prometheus_port, "moesnap_journal_writes_total").value_or(0), 1);
}

TEST_F(OperationsTest, PromtoolAcceptsTheExposition) {
  TestDaemon daemon({.pool_bytes = "64MiB"});
  ASSERT_TRUE(daemon.Start());
  ASSERT_NO_FATAL_FAILURE(CommitOneStep(daemon));
  absl::StatusOr<testing::HttpReply> metrics = HttpGet(daemon.http_port(), "/metrics");
  ASSERT_OK(metrics);
  EXPECT_EQ(metrics->status, 200);
  EXPECT_EQ(metrics->content_type, "text/plain; version=0.0.4; charset=utf-8");
  const std::string path = daemon.directory() + "/metrics.txt";
  std::ofstream(path) << metrics->body;
  ChildProcess promtool({"/bin/sh", "-c", "exec promtool check metrics < " + path}, {},
                        ChildProcess::Stderr::kCapture);
  std::string complaints;
  while (std::optional<std::string> line = promtool.ReadLine(30s)) complaints += *line + "\n";
  EXPECT_EQ(promtool.Wait(30s), 0) << complaints;
  EXPECT_EQ(complaints, "");
  // The families the issue asks for are there, with their units in the names.
  for (const char* family :
       {"# TYPE moesnap_snapshot_bytes_total counter", "# TYPE moesnap_snapshot_blocking_seconds histogram",
        "# TYPE moesnap_capture_duration_seconds histogram",
        "# TYPE moesnap_commit_duration_seconds histogram", "moesnap_steps_total{outcome=\"superseded\"} 0",
        "# TYPE moesnap_pool_free_bytes gauge", "# TYPE moesnap_journal_writes_total counter",
        "# TYPE moesnap_rebuild_bytes_total counter", "# TYPE moesnap_upstream_log_bytes gauge",
        "moesnap_durable_enabled 0\n"}) {
    EXPECT_TRUE(absl::StrContains(metrics->body, family)) << family;
  }
}

// grpc.health.v1.Health/Check with an empty service name, over a Unix socket: the serving status
// (1 SERVING, 2 NOT_SERVING) from the response's one field.
absl::StatusOr<int> GrpcHealth(const std::string& socket) {
  grpc::GenericStub stub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 10s);
  grpc::CompletionQueue queue;
  grpc::Slice empty("", 0);
  grpc::ByteBuffer request(&empty, 1);
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
      stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request, &queue);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  queue.Next(&tag, &ok);
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("unreadable response");
  std::string bytes;
  for (const grpc::Slice& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  if (bytes.size() != 2 || bytes[0] != 0x08) return absl::InternalError("unexpected health response");
  return static_cast<int>(bytes[1]);
}

TEST_F(OperationsTest, HealthEndpointsAndTheGrpcHealthServiceOnBothSockets) {
  TestDaemon daemon({.pool_bytes = "64MiB"});
  ASSERT_TRUE(daemon.Start());  // returns once the agent socket accepts, before the first probe
  for (const char* path : {"/healthz", "/readyz"}) {
    std::string last;
    EXPECT_TRUE(Eventually([&] {
      absl::StatusOr<testing::HttpReply> reply = HttpGet(daemon.http_port(), path);
      last = reply.ok() ? absl::StrCat(reply->status, " ", reply->body) : reply.status().ToString();
      return reply.ok() && reply->status == 200 && reply->body == "ok\n";
    })) << path << ": " << last;
  }
  for (const std::string& socket : {daemon.agent_socket(), daemon.admin_socket()}) {
    absl::StatusOr<int> serving;
    EXPECT_TRUE(Eventually([&] {
      serving = GrpcHealth(socket);
      return serving.ok() && *serving == 1;
    })) << socket << " should answer SERVING: " << serving.status();
  }
}

// A NOTIFY_SOCKET as systemd listens on it: a datagram per sd_notify call.
class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) : path_(path) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    bound_ = bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  }
  ~NotifySocket() { close(fd_); }
  bool bound() const { return bound_; }

  // The next message, or nullopt after `timeout`.
  std::optional<std::string> Next(std::chrono::milliseconds timeout) {
    pollfd watched{fd_, POLLIN, 0};
    if (poll(&watched, 1, static_cast<int>(timeout.count())) != 1) return std::nullopt;
    char buffer[4096];
    const ssize_t length = recv(fd_, buffer, sizeof(buffer), 0);
    if (length < 0) return std::nullopt;
    return std::string(buffer, length);
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool bound_ = false;
};

TEST_F(OperationsTest, NotifiesReadyThenPingsTheWatchdogOnlyWhileItAnswersItsProbe) {
  TestDaemon daemon({.pool_bytes = "64MiB"});
  NotifySocket notify(daemon.directory() + "/notify.sock");
  ASSERT_TRUE(notify.bound());
  // WatchdogSec=300ms: the daemon probes itself and pings every 150 ms.
  ASSERT_TRUE(daemon.Start({"NOTIFY_SOCKET=" + daemon.directory() + "/notify.sock",
                            "WATCHDOG_USEC=300000"}));
  std::optional<std::string> first = notify.Next(30s);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(*first, "READY=1\nSTATUS=serving node 0");
  // READY=1 came after the daemon answered on its sockets: health is already good.
  absl::StatusOr<testing::HttpReply> healthy = HttpGet(daemon.http_port(), "/healthz");
  ASSERT_OK(healthy);
  EXPECT_EQ(healthy->status, 200);
  int pings = 0;
  while (pings < 3) {
    std::optional<std::string> message = notify.Next(30s);
    ASSERT_TRUE(message.has_value()) << "no WATCHDOG=1 after " << pings;
    if (*message == "WATCHDOG=1") ++pings;
  }

  // The admin socket vanishes (a tmpfiles cleanup, say): the daemon's own probe fails, so it
  // stops pinging and /healthz says why, though the process still runs.
  while (notify.Next(0ms)) {
  }
  ASSERT_EQ(unlink(daemon.admin_socket().c_str()), 0);
  ASSERT_TRUE(Eventually([&] {
    absl::StatusOr<testing::HttpReply> reply = HttpGet(daemon.http_port(), "/healthz");
    return reply.ok() && reply->status == 503 &&
           absl::StrContains(reply->body, "did not answer a status call");
  })) << "/healthz never reported the failing probe";
  // /healthz turns 503 only after three probe intervals without success; a blind timer would
  // have pinged about three times since the unlink. One probe may have been in flight.
  int pings_after_unlink = 0;
  while (std::optional<std::string> message = notify.Next(0ms)) {
    if (*message == "WATCHDOG=1") ++pings_after_unlink;
  }
  EXPECT_LE(pings_after_unlink, 1);

  daemon.Kill(SIGTERM);
  bool stopping = false;
  while (std::optional<std::string> message = notify.Next(0ms)) stopping |= *message == "STOPPING=1";
  EXPECT_TRUE(stopping);
}

}  // namespace
}  // namespace moesnap
