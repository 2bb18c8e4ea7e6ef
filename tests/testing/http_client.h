// A minimal HTTP/1.1 client for tests (Boost.Beast): GET a path on 127.0.0.1, or send raw bytes
// and read whatever comes back. Every call has a deadline.
#ifndef MOESNAP_TESTS_TESTING_HTTP_CLIENT_H_
#define MOESNAP_TESTS_TESTING_HTTP_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace moesnap::testing {

struct HttpReply {
  int status = 0;
  std::string content_type;
  std::string body;
};

absl::StatusOr<HttpReply> HttpGet(uint16_t port, const std::string& target,
                                  std::chrono::milliseconds timeout = std::chrono::seconds(10));

// Writes `request` as is and returns every byte the server sends until it closes (or `timeout`).
absl::StatusOr<std::string> HttpRaw(uint16_t port, const std::string& request,
                                    std::chrono::milliseconds timeout = std::chrono::seconds(10));

}  // namespace moesnap::testing

#endif  // MOESNAP_TESTS_TESTING_HTTP_CLIENT_H_
