// HttpServer in process: routes, 404 and 405, keep-alive, and requests beyond the header bound.
#include "daemon/http_server.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/testing/http_client.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

using testing::HttpGet;
using testing::HttpRaw;

std::unique_ptr<HttpServer> StartServer() {
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Listen("127.0.0.1:0");
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  (*server)->Serve(
      {{"/metrics", [] { return HttpResponse{200, "text/plain; version=0.0.4", "m 1\n"}; }},
       {"/readyz", [] { return HttpResponse{503, "text/plain", "rebuilding\n"}; }}});
  return *std::move(server);
}

TEST(HttpServerTest, ServesRoutesAndNamesThemOnA404) {
  std::unique_ptr<HttpServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->port(), 0);
  absl::StatusOr<testing::HttpReply> metrics = HttpGet(server->port(), "/metrics?x=1");
  ASSERT_OK(metrics);
  EXPECT_EQ(metrics->status, 200);
  EXPECT_EQ(metrics->content_type, "text/plain; version=0.0.4");
  EXPECT_EQ(metrics->body, "m 1\n");
  absl::StatusOr<testing::HttpReply> ready = HttpGet(server->port(), "/readyz");
  ASSERT_OK(ready);
  EXPECT_EQ(ready->status, 503);
  EXPECT_EQ(ready->body, "rebuilding\n");
  absl::StatusOr<testing::HttpReply> missing = HttpGet(server->port(), "/nothing");
  ASSERT_OK(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(missing->body, "no such path; served: /metrics /readyz\n");
}

TEST(HttpServerTest, RefusesOtherMethodsAndOversizedRequests) {
  std::unique_ptr<HttpServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  absl::StatusOr<std::string> post =
      HttpRaw(server->port(), "POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  ASSERT_OK(post);
  EXPECT_TRUE(absl::StartsWith(*post, "HTTP/1.1 405")) << *post;
  // A body is refused: the parser's limit is 0 bytes, and the connection is dropped unanswered.
  absl::StatusOr<std::string> body = HttpRaw(
      server->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
  ASSERT_OK(body);
  EXPECT_EQ(*body, "");
  const std::string huge(16 << 10, 'a');
  absl::StatusOr<std::string> oversized =
      HttpRaw(server->port(), absl::StrCat("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: ", huge, "\r\n\r\n"));
  ASSERT_OK(oversized);
  EXPECT_EQ(*oversized, "");
  // Still serving.
  absl::StatusOr<testing::HttpReply> metrics = HttpGet(server->port(), "/metrics");
  ASSERT_OK(metrics);
  EXPECT_EQ(metrics->status, 200);
}

TEST(HttpServerTest, KeepsAConnectionAliveForSeveralRequests) {
  std::unique_ptr<HttpServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  absl::StatusOr<std::string> two = HttpRaw(
      server->port(),
      "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  ASSERT_OK(two);
  size_t answers = 0;
  for (size_t at = two->find("HTTP/1.1 200"); at != std::string::npos; at = two->find("HTTP/1.1 200", at + 1)) {
    ++answers;
  }
  EXPECT_EQ(answers, 2u) << *two;
}

TEST(HttpServerTest, ParsesAndRefusesAddresses) {
  EXPECT_EQ(*ParseHttpAddress("127.0.0.1:7442"), (std::pair<std::string, uint16_t>("127.0.0.1", 7442)));
  EXPECT_EQ(*ParseHttpAddress("[::1]:0"), (std::pair<std::string, uint16_t>("::1", 0)));
  for (const char* bad : {"localhost:7442", "127.0.0.1", "127.0.0.1:70000", "127.0.0.1:x", ":7442"}) {
    EXPECT_STATUS(ParseHttpAddress(bad), absl::StatusCode::kInvalidArgument) << bad;
  }
  std::unique_ptr<HttpServer> first = StartServer();
  ASSERT_NE(first, nullptr);
  absl::StatusOr<std::unique_ptr<HttpServer>> second =
      HttpServer::Listen(absl::StrCat("127.0.0.1:", first->port()));
  ASSERT_STATUS(second, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(second.status().message(), "http.address")) << second.status();
}

}  // namespace
}  // namespace moesnap::daemon
