// A trainer process as tests against a real daemon make it through the client library: one host
// region, "weights". Header only: moesnap_testing does not link the client (c_api_test takes it
// from the client's shared library), so only tests that link it include this.
#ifndef MOESNAP_TESTS_TESTING_HOST_TRAINER_H_
#define MOESNAP_TESTS_TESTING_HOST_TRAINER_H_

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "moesnap/client.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::testing {

struct HostTrainer {
  std::unique_ptr<Client> client;
  std::shared_ptr<SharedBuffer> weights;
};

// Connects with `options` and registers `bytes` of weights; call under ASSERT_NO_FATAL_FAILURE.
inline void ConnectHostTrainer(const ClientOptions& options, size_t bytes, HostTrainer* trainer) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_OK(client);
  absl::StatusOr<std::shared_ptr<SharedBuffer>> weights = (*client)->AllocateHost(bytes);
  ASSERT_OK(weights);
  ASSERT_OK((*client)->RegisterHostRegion({"weights", "uint8", {static_cast<int64_t>(bytes)}},
                                          *weights, 0, bytes));
  *trainer = {*std::move(client), *std::move(weights)};
}

}  // namespace moesnap::testing

#endif  // MOESNAP_TESTS_TESTING_HOST_TRAINER_H_
