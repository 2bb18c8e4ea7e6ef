// HealthMonitor with a fake probe and a fake service manager: WATCHDOG=1 follows successful probes
// only, liveness lapses when probes fail, readiness follows both, and the serving callback fires
// on changes.
#include "daemon/health.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace moesnap::daemon {
namespace {

class FakeNotifier : public ServiceNotifier {
 public:
  explicit FakeNotifier(std::optional<absl::Duration> watchdog) : watchdog_(watchdog) {}
  void Notify(const std::string& state) override {
    absl::MutexLock lock(&mutex_);
    states_.push_back(state);
  }
  std::optional<absl::Duration> WatchdogInterval() override { return watchdog_; }
  int Count(const std::string& state) {
    absl::MutexLock lock(&mutex_);
    return static_cast<int>(std::count(states_.begin(), states_.end(), state));
  }

 private:
  std::optional<absl::Duration> watchdog_;
  absl::Mutex mutex_;
  std::vector<std::string> states_;
};

// Polls `condition` until it holds or 10 s pass.
template <typename Condition>
bool Eventually(Condition condition) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return condition();
}

TEST(HealthMonitorTest, PingsTheWatchdogOnlyAfterSuccessfulProbes) {
  FakeNotifier notifier(absl::Milliseconds(5));
  std::atomic<bool> healthy{true};
  std::atomic<int> probes{0};
  std::atomic<int> serving_changes{0};
  std::atomic<bool> serving{false};
  HealthMonitor monitor(
      {.probe =
           [&] {
             ++probes;
             return healthy ? absl::OkStatus() : absl::UnavailableError("the store is wedged");
           },
       .ready = [] { return absl::OkStatus(); },
       .on_serving_changed =
           [&](bool now) {
             serving = now;
             ++serving_changes;
           }},
      &notifier);
  ASSERT_TRUE(Eventually([&] { return probes >= 3; }));
  EXPECT_EQ(notifier.Count("WATCHDOG=1"), 0) << "no ping before READY=1";
  monitor.AnnounceReady("serving");
  EXPECT_EQ(notifier.Count("READY=1\nSTATUS=serving"), 1);
  ASSERT_TRUE(Eventually([&] { return notifier.Count("WATCHDOG=1") >= 3; }));
  EXPECT_TRUE(serving);
  EXPECT_TRUE(monitor.Alive().ok());
  EXPECT_TRUE(monitor.Ready().ok());

  healthy = false;
  const int probes_when_wedged = probes;
  ASSERT_TRUE(Eventually([&] { return probes >= probes_when_wedged + 2; }));
  const int pings = notifier.Count("WATCHDOG=1");
  ASSERT_TRUE(Eventually([&] { return probes >= probes_when_wedged + 6; }));
  EXPECT_EQ(notifier.Count("WATCHDOG=1"), pings) << "a failing probe must not ping";
  EXPECT_FALSE(serving);
  ASSERT_TRUE(Eventually([&] { return !monitor.Alive().ok(); }));
  EXPECT_EQ(monitor.Alive().message(), "the store is wedged");
  EXPECT_FALSE(monitor.Ready().ok());

  healthy = true;
  ASSERT_TRUE(Eventually([&] { return notifier.Count("WATCHDOG=1") > pings && serving; }));
  EXPECT_EQ(serving_changes, 3);  // serving, not serving, serving
}

TEST(HealthMonitorTest, WithoutAWatchdogProbesButNeverPings) {
  FakeNotifier notifier(std::nullopt);
  std::atomic<int> probes{0};
  std::atomic<bool> ready{false};
  HealthMonitor monitor({.probe = [&] { ++probes; return absl::OkStatus(); },
                         .ready = [&] { return ready ? absl::OkStatus() : absl::UnavailableError("rebuilding"); },
                         .on_serving_changed = nullptr,
                         .interval = absl::Milliseconds(5)},
                        &notifier);
  ASSERT_TRUE(Eventually([&] { return probes >= 3; }));
  EXPECT_EQ(notifier.Count("WATCHDOG=1"), 0);
  EXPECT_TRUE(monitor.Alive().ok());
  EXPECT_EQ(monitor.Ready().message(), "rebuilding");
  ready = true;
  EXPECT_TRUE(monitor.Ready().ok());
}

}  // namespace
}  // namespace moesnap::daemon
