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
  {
    PeerRequests requests(2, 1, 3);
    for (int i = 0; i < 3; ++i) {
      ASSERT_OK(requests.Add(4, [&] { release.WaitForNotification(); }));
    }
    const absl::Status refused = requests.Add(4, [] {});
    EXPECT_STATUS(refused, absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(absl::StrContains(refused.message(), "node 4 has 3 requests queued or running"))
        << refused;
    EXPECT_EQ(requests.pending(4), 3);
    // Node 4 holds one thread; node 5's request runs on the other.
    absl::Notification served;
    ASSERT_OK(requests.Add(5, [&] { served.Notify(); }));
    EXPECT_TRUE(served.WaitForNotificationWithTimeout(kPatience));
    release.Notify();
  }
}

TEST(PeerRequestsTest, APeersRequestsRunInOrderOnAtMostItsShareOfTheThreads) {
  absl::Mutex mutex;
  int running = 0;
  std::vector<int> started;
  absl::Notification release;
  {
    PeerRequests requests(3, 2, 16);
    for (int i = 0; i < 4; ++i) {
      ASSERT_OK(requests.Add(7, [&, i] {
        {
          absl::MutexLock lock(&mutex);
          started.push_back(i);
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
    ASSERT_OK(requests.Add(8, [&] { served.Notify(); }));
    EXPECT_TRUE(served.WaitForNotificationWithTimeout(kPatience));
    {
      absl::MutexLock lock(&mutex);
      EXPECT_EQ(running, 2);
      std::vector<int> first = started;
      std::sort(first.begin(), first.end());
      EXPECT_EQ(first, (std::vector<int>{0, 1}));
    }
    EXPECT_EQ(requests.pending(7), 4);
    release.Notify();
    absl::MutexLock lock(&mutex);
    EXPECT_TRUE(mutex.AwaitWithTimeout(
        absl::Condition(+[](std::vector<int>* all) { return all->size() == 4; }, &started),
        kPatience));
  }
}

}  // namespace
}  // namespace moesnap::daemon::cluster
