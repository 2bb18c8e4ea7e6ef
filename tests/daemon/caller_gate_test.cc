// The bound on calls in flight per caller (the Peer service's nodes, the Agent service's ranks): a
// caller's calls beyond the bound are refused by name and counted in the owner's metric, other
// callers are not affected, and a slot is free again when its call ends.
#include "daemon/caller_gate.h"

#include <gtest/gtest.h>

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "common/metrics.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

TEST(CallerGateTest, ACallerBeyondItsBoundIsRefusedAndOthersAreNot) {
  metrics::Counter refusals;
  CallerGate gate(3, &refusals);
  std::vector<CallerGate::Pass> held;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<CallerGate::Pass> pass = gate.Enter("node 4");
    ASSERT_OK(pass);
    held.push_back(*std::move(pass));
  }
  const absl::StatusOr<CallerGate::Pass> refused = gate.Enter("node 4");
  EXPECT_STATUS(refused.status(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "node 4 has 3 calls in flight"))
      << refused.status();
  EXPECT_EQ(gate.in_flight("node 4"), 3);
  EXPECT_EQ(refusals.value(), 1u);
  {
    const absl::StatusOr<CallerGate::Pass> other = gate.Enter("node 5");
    ASSERT_OK(other);
    EXPECT_EQ(gate.in_flight("node 5"), 1);
  }
  EXPECT_EQ(gate.in_flight("node 5"), 0);
  held.pop_back();
  EXPECT_EQ(gate.in_flight("node 4"), 2);
  const absl::StatusOr<CallerGate::Pass> again = gate.Enter("node 4");
  EXPECT_OK(again);
}

TEST(CallerGateTest, AMovedPassHoldsItsSlotOnce) {
  metrics::Counter refusals;
  CallerGate gate(1, &refusals);
  std::optional<CallerGate::Pass> moved;
  {
    absl::StatusOr<CallerGate::Pass> pass = gate.Enter("node 1");
    ASSERT_OK(pass);
    moved.emplace(*std::move(pass));
  }
  EXPECT_EQ(gate.in_flight("node 1"), 1);
  EXPECT_STATUS(gate.Enter("node 1").status(), absl::StatusCode::kResourceExhausted);
  moved.reset();
  EXPECT_EQ(gate.in_flight("node 1"), 0);
}

}  // namespace
}  // namespace moesnap::daemon
