// HttpServer: an accept loop and one reader/writer per connection, all on one io_context thread.
#include "daemon/http_server.h"

#include <atomic>
#include <chrono>
#include <optional>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace moesnap::daemon {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

constexpr size_t kMaxHeaderBytes = 8192;
constexpr std::chrono::seconds kRequestDeadline(10);  // a slow or idle client is dropped then
using Routes = std::map<std::string, HttpServer::Handler>;

}  // namespace

absl::StatusOr<std::pair<std::string, uint16_t>> ParseHttpAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected IP:PORT such as 127.0.0.1:7442 or [::1]:7442, got '", address, "'"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = -1;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a port in [0, 65535] after the last ':', got '", address, "'"));
  }
  boost::system::error_code error;
  asio::ip::make_address(host, error);
  if (error) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected an IP address before the port, got '", host, "'"));
  }
  return std::pair<std::string, uint16_t>(host, static_cast<uint16_t>(port));
}

class HttpServer::Impl {
 public:
  void Accept();

  std::map<std::string, Handler> routes_;
  std::atomic<int> open_connections_{0};  // declared before io_: outlives the connections io_ holds
  asio::io_context io_;
  tcp::acceptor acceptor_{io_};
  std::thread thread_;
};

namespace {

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, const Routes* routes, std::atomic<int>* open)
      : stream_(std::move(socket)), routes_(routes), open_(open) {}
  ~Connection() { open_->fetch_sub(1); }

  void Read() {
    parser_.emplace();
    parser_->header_limit(kMaxHeaderBytes);
    parser_->body_limit(0);
    stream_.expires_after(kRequestDeadline);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code error, size_t) {
                       self->OnRead(error);
                     });
  }

 private:
  void OnRead(beast::error_code error);

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_{kMaxHeaderBytes};
  std::optional<http::request_parser<http::empty_body>> parser_;
  http::response<http::string_body> response_;
  const Routes* routes_;
  std::atomic<int>* open_;
};

HttpResponse Respond(const Routes& routes, const http::request<http::empty_body>& request) {
  if (request.method() != http::verb::get) {
    return {405, "text/plain; charset=utf-8", "only GET is served\n"};
  }
  std::string path(request.target());
  if (const size_t query = path.find('?'); query != std::string::npos) path.resize(query);
  const auto route = routes.find(path);
  if (route == routes.end()) {
    std::string known;
    for (const auto& [name, handler] : routes) absl::StrAppend(&known, " ", name);
    return {404, "text/plain; charset=utf-8", absl::StrCat("no such path; served:", known, "\n")};
  }
  return route->second();
}

void Connection::OnRead(beast::error_code error) {
  if (error) return;  // closed, timed out or malformed: the connection is dropped
  const http::request<http::empty_body>& request = parser_->get();
  HttpResponse answer = Respond(*routes_, request);
  response_ = http::response<http::string_body>(static_cast<http::status>(answer.status),
                                                request.version());
  response_.set(http::field::content_type, answer.content_type);
  response_.set(http::field::server, "moesnapd");
  response_.body() = std::move(answer.body);
  response_.keep_alive(request.keep_alive());
  response_.prepare_payload();
  http::async_write(stream_, response_,
                    [self = shared_from_this()](beast::error_code write_error, size_t) {
                      if (write_error || !self->response_.keep_alive()) {
                        beast::error_code ignored;
                        self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
                        return;
                      }
                      self->Read();
                    });
}

}  // namespace

void HttpServer::Impl::Accept() {
  acceptor_.async_accept([this](beast::error_code error, tcp::socket socket) {
    if (error == asio::error::operation_aborted) return;  // stopping
    if (!error) {
      if (open_connections_.fetch_add(1) >= kMaxConnections) {
        open_connections_.fetch_sub(1);
        Log(LogLevel::kWarning, "HTTP: refused a connection, ", kMaxConnections, " are open");
      } else {
        std::make_shared<Connection>(std::move(socket), &routes_, &open_connections_)->Read();
      }
    }
    Accept();
  });
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Listen(const std::string& address) {
  absl::StatusOr<std::pair<std::string, uint16_t>> parsed = ParseHttpAddress(address);
  if (!parsed.ok()) return parsed.status();
  auto impl = std::make_unique<Impl>();
  const tcp::endpoint endpoint(asio::ip::make_address(parsed->first), parsed->second);
  boost::system::error_code error;
  impl->acceptor_.open(endpoint.protocol(), error);
  if (!error) impl->acceptor_.set_option(asio::socket_base::reuse_address(true), error);
  if (!error) impl->acceptor_.bind(endpoint, error);
  if (!error) impl->acceptor_.listen(asio::socket_base::max_listen_connections, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve HTTP on ", address, " (http.address): ", error.message()));
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

void HttpServer::Serve(std::map<std::string, Handler> routes) {
  impl_->routes_ = std::move(routes);
  impl_->Accept();
  impl_->thread_ = std::thread([raw = impl_.get()] { raw->io_.run(); });
}

HttpServer::~HttpServer() {
  impl_->io_.stop();
  if (impl_->thread_.joinable()) impl_->thread_.join();
}

uint16_t HttpServer::port() const { return impl_->acceptor_.local_endpoint().port(); }

}  // namespace moesnap::daemon
