// Assertions on absl::Status and absl::StatusOr for every moesnap test. Each evaluates its argument
// exactly once (a call passed in is not run again to build the failure message), and takes more
// message with <<, as gtest's own assertions do.
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

// `fail` is FAIL or ADD_FAILURE. The status is copied out of the argument's temporary, once.
#define MOESNAP_STATUS_CHECK_(expr, expected_code, fail)                                        \
  switch (0)                                                                                    \
  case 0:                                                                                       \
  default:                                                                                      \
    if (const ::absl::Status moesnap_checked_status_ = ::moesnap::testing::StatusOf(expr);      \
        moesnap_checked_status_.code() == (expected_code)) {                                    \
    } else                                                                                      \
      fail() << #expr << " is " << moesnap_checked_status_ << ", expected "                    \
             << ::absl::StatusCodeToString(expected_code) << " "

#define ASSERT_OK(expr) MOESNAP_STATUS_CHECK_(expr, ::absl::StatusCode::kOk, FAIL)
#define EXPECT_OK(expr) MOESNAP_STATUS_CHECK_(expr, ::absl::StatusCode::kOk, ADD_FAILURE)
#define ASSERT_STATUS(expr, expected_code) MOESNAP_STATUS_CHECK_(expr, expected_code, FAIL)
#define EXPECT_STATUS(expr, expected_code) MOESNAP_STATUS_CHECK_(expr, expected_code, ADD_FAILURE)

#endif  // MOESNAP_TESTS_TESTING_STATUS_MATCHERS_H_
