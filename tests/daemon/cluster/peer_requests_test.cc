// Requests peers make of this node run on threads of their own: a peer's beyond its bound are
// refused by name while other peers' go on, and one peer's run in order on at most its share of
// the threads, so that a peer that stopped reading holds only those.
#include "daemon/cluster/peer_requests.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

constexpr absl::Duration kPatience = absl::Seconds(30);

TEST(PeerRequestsTest, APeerBeyondItsBoundIsRefusedAndOthersAreServed) {
  absl::Notification release;
  absl::Mutex mutex;
  std::vector<int> aheads;
  {
    PeerRequests requests(2, 1, 3);
    for (int i = 0; i < 3; ++i) {
      ASSERT_OK(requests.Add(4, [&](int ahead) {
        release.WaitForNotification();
        absl::MutexLock lock(&mutex);
        aheads.push_back(ahead);
      }));
    }
    const absl::Status refused = requests.Add(4, [](int) {});
    EXPECT_STATUS(refused, absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(absl::StrContains(refused.message(), "node 4 has 3 requests queued or running"))
        << refused;
    // Node 4 holds one thread; node 5's request runs on the other, with none of node 5's ahead.
    absl::Notification served;
    int served_ahead = -1;
    ASSERT_OK(requests.Add(5, [&](int ahead) {
      served_ahead = ahead;
      served.Notify();
    }));
    EXPECT_TRUE(served.WaitForNotificationWithTimeout(kPatience));
    EXPECT_EQ(served_ahead, 0);
    release.Notify();
    absl::MutexLock lock(&mutex);
    EXPECT_TRUE(mutex.AwaitWithTimeout(
        absl::Condition(+[](std::vector<int>* all) { return all->size() == 3; }, &aheads),
        kPatience));
  }
  // Each of node 4's requests was told how many of its own were ahead of it, in order.
  EXPECT_EQ(aheads, (std::vector<int>{0, 1, 2}));
}

TEST(PeerRequestsTest, APeersRequestsRunInOrderOnAtMostItsShareOfTheThreads) {
  absl::Mutex mutex;
  int running = 0;
  std::vector<int> started;
  std::vector<int> aheads(4, -1);
  absl::Notification release;
  {
    PeerRequests requests(3, 2, 16);
    for (int i = 0; i < 4; ++i) {
      ASSERT_OK(requests.Add(7, [&, i](int ahead) {
        {
          absl::MutexLock lock(&mutex);
          started.push_back(i);
          aheads[i] = ahead;
          ++running;
        }
        release.WaitForNotification();
        absl::MutexLock lock(&mutex);
        --running;
      }));
    }
    {
      absl::MutexLock lock(&mutex);
      ASSERT_TRUE(mutex.AwaitWithTimeout(
          absl::Condition(+[](int* count) { return *count == 2; }, &running), kPatience));
    }
    // Node 7 holds two threads, its first two requests; node 8's request runs on the third.
    absl::Notification served;
    ASSERT_OK(requests.Add(8, [&](int) { served.Notify(); }));
    EXPECT_TRUE(served.WaitForNotificationWithTimeout(kPatience));
    {
      absl::MutexLock lock(&mutex);
      EXPECT_EQ(running, 2);
      std::vector<int> first = started;
      std::sort(first.begin(), first.end());
      EXPECT_EQ(first, (std::vector<int>{0, 1}));
    }
    release.Notify();
    absl::MutexLock lock(&mutex);
    EXPECT_TRUE(mutex.AwaitWithTimeout(
        absl::Condition(+[](std::vector<int>* all) { return all->size() == 4; }, &started),
        kPatience));
  }
  EXPECT_EQ(aheads, (std::vector<int>{0, 1, 2, 3}));
}

}  // namespace
}  // namespace moesnap::daemon::cluster
