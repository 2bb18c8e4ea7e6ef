// The daemon's HTTP endpoint for operators' tools: Prometheus scrapes /metrics, orchestrators probe
// /healthz and /readyz. Boost.Beast on one Asio thread. Every request is bounded (8 KiB of request
// line and headers, no body), every connection has a deadline, and at most kMaxConnections are
// open at once; only GET is served.
#ifndef MOESNAP_DAEMON_HTTP_SERVER_H_
#define MOESNAP_DAEMON_HTTP_SERVER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace moesnap::daemon {

struct HttpOptions {
  // "IP:PORT" ("[::1]:7442" for IPv6); port 0 takes a free one. Empty: no HTTP endpoint. Loopback
  // by default: metrics and health are for the node's own agents unless the operator opens them.
  std::string address = "127.0.0.1:7442";
};

// "127.0.0.1:7442" or "[::1]:7442" into an IP literal and a port; errors say what was expected.
absl::StatusOr<std::pair<std::string, uint16_t>> ParseHttpAddress(const std::string& address);

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// Not thread-safe to construct or destroy; handlers run on the server's own thread, one at a time.
class HttpServer {
 public:
  static constexpr int kMaxConnections = 32;
  using Handler = std::function<HttpResponse()>;

  // Binds and listens on `address`; connections wait in the backlog until Serve. A daemon binds
  // before any of its sockets serves, so one that cannot have its port fails before it answers.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Listen(const std::string& address);
  // Serves `routes` (exact paths; a query string is ignored). Once.
  void Serve(std::map<std::string, Handler> routes);
  ~HttpServer();  // stops serving and closes every connection

  uint16_t port() const;

 private:
  class Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_HTTP_SERVER_H_
