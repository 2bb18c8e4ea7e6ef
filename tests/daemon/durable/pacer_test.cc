// The drain's rate limit, on a fake clock.
#include "daemon/durable/pacer.h"

#include <gtest/gtest.h>

#include "tests/daemon/durable/fakes.h"

namespace moesnap::daemon::durable {
namespace {

TEST(PacerTest, WritesTakeAtLeastBytesOverRate) {
  FakeClock clock;
  Pacer pacer(1 << 20, &clock);  // 1 MiB/s
  std::atomic<bool> stop{false};
  pacer.Start();
  const absl::Time start = clock.Now();
  for (int i = 0; i < 10; ++i) pacer.Account(1 << 20, stop);
  EXPECT_GE(clock.Now() - start, absl::Seconds(10));
  EXPECT_LT(clock.Now() - start, absl::Seconds(10.2));
}

TEST(PacerTest, TimeAlreadySpentWritingCountsAgainstTheWait) {
  FakeClock clock;
  Pacer pacer(1 << 20, &clock);
  std::atomic<bool> stop{false};
  pacer.Start();
  clock.Advance(absl::Seconds(3));  // the disk itself took 3 s for 2 MiB
  pacer.Account(2 << 20, stop);
  EXPECT_EQ(clock.slept(), absl::ZeroDuration());
}

TEST(PacerTest, NoLimitNeverSleepsAndStopEndsAWait) {
  FakeClock clock;
  std::atomic<bool> stop{false};
  Pacer unlimited(0, &clock);
  unlimited.Start();
  unlimited.Account(uint64_t{1} << 40, stop);
  EXPECT_EQ(clock.slept(), absl::ZeroDuration());
  Pacer slow(1, &clock);  // 1 byte per second
  slow.Start();
  stop = true;
  slow.Account(1 << 20, stop);
  EXPECT_EQ(clock.slept(), absl::ZeroDuration());
}

}  // namespace
}  // namespace moesnap::daemon::durable
