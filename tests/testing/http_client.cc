#include "tests/testing/http_client.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "absl/strings/str_cat.h"

namespace moesnap::testing {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

}  // namespace

absl::StatusOr<HttpReply> HttpGet(uint16_t port, const std::string& target,
                                  std::chrono::milliseconds timeout) {
  asio::io_context io;
  beast::tcp_stream stream(io);
  stream.expires_after(timeout);
  beast::error_code error;
  stream.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port), error);
  if (error) return absl::UnavailableError(absl::StrCat("connect to port ", port, ": ", error.message()));
  http::request<http::empty_body> request(http::verb::get, target, 11);
  request.set(http::field::host, absl::StrCat("127.0.0.1:", port));
  request.keep_alive(false);
  http::write(stream, request, error);
  if (error) return absl::UnavailableError(absl::StrCat("write: ", error.message()));
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(64 << 20);
  http::read(stream, buffer, parser, error);
  if (error) return absl::UnavailableError(absl::StrCat("read ", target, ": ", error.message()));
  const http::response<http::string_body>& response = parser.get();
  return HttpReply{static_cast<int>(response.result_int()),
                   std::string(response[http::field::content_type]), response.body()};
}

absl::StatusOr<std::string> HttpRaw(uint16_t port, const std::string& request,
                                    std::chrono::milliseconds timeout) {
  asio::io_context io;
  beast::tcp_stream stream(io);
  stream.expires_after(timeout);
  beast::error_code error;
  stream.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port), error);
  if (error) return absl::UnavailableError(absl::StrCat("connect to port ", port, ": ", error.message()));
  asio::write(stream, asio::buffer(request), error);
  if (error) return absl::UnavailableError(absl::StrCat("write: ", error.message()));
  std::string received;
  char chunk[4096];
  while (true) {
    const size_t read = stream.read_some(asio::buffer(chunk), error);
    received.append(chunk, read);
    if (error == asio::error::eof || error == asio::error::connection_reset) return received;
    if (error) return absl::DeadlineExceededError(absl::StrCat("read: ", error.message()));
  }
}

}  // namespace moesnap::testing
