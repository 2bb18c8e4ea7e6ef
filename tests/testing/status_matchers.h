// Assertions on absl::Status and absl::StatusOr for every moesnap test.
#ifndef MOESNAP_TESTS_TESTING_STATUS_MATCHERS_H_
#define MOESNAP_TESTS_TESTING_STATUS_MATCHERS_H_

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moesnap::testing {

inline const absl::Status& StatusOf(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

}  // namespace moesnap::testing

#define ASSERT_OK(expr) ASSERT_TRUE(::moesnap::testing::StatusOf(expr).ok()) \
    << ::moesnap::testing::StatusOf(expr)
#define EXPECT_OK(expr) EXPECT_TRUE(::moesnap::testing::StatusOf(expr).ok()) \
    << ::moesnap::testing::StatusOf(expr)
#define ASSERT_STATUS(expr, expected_code) \
  ASSERT_EQ(::moesnap::testing::StatusOf(expr).code(), (expected_code)) \
      << ::moesnap::testing::StatusOf(expr)
#define EXPECT_STATUS(expr, expected_code) \
  EXPECT_EQ(::moesnap::testing::StatusOf(expr).code(), (expected_code)) \
      << ::moesnap::testing::StatusOf(expr)

#endif  // MOESNAP_TESTS_TESTING_STATUS_MATCHERS_H_
