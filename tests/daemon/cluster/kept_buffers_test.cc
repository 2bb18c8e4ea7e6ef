// The buffers a node reads fetched bytes into: a returned buffer serves the next fetch that fits in
// it, the bytes kept never pass the bound, and a larger buffer displaces smaller ones.
#include "daemon/cluster/kept_buffers.h"

#include <gtest/gtest.h>

#include <cstring>
#include <utility>

namespace moesnap::daemon::cluster {
namespace {

constexpr uint64_t kMiB = KeptBuffers::kGranule;

TEST(KeptBuffersTest, AReturnedBufferServesTheNextFetchThatFits) {
  KeptBuffers buffers(8 * kMiB);
  uint8_t* first = nullptr;
  {
    KeptBuffers::Lease lease = buffers.Take(3 * kMiB + 5);
    EXPECT_EQ(lease.capacity(), 4 * kMiB);  // rounded up to the granule
    std::memset(lease.data(), 0xab, 3 * kMiB + 5);
    first = lease.data();
    EXPECT_EQ(buffers.kept_bytes(), 0u);  // in use, not kept
  }
  EXPECT_EQ(buffers.kept_bytes(), 4 * kMiB);
  {
    const KeptBuffers::Lease same = buffers.Take(2 * kMiB);
    EXPECT_EQ(same.data(), first);
    EXPECT_EQ(same.capacity(), 4 * kMiB);
    EXPECT_EQ(buffers.kept_bytes(), 0u);
    // A second fetch at the same time gets a buffer of its own.
    const KeptBuffers::Lease other = buffers.Take(2 * kMiB);
    EXPECT_NE(other.data(), first);
  }
  EXPECT_EQ(buffers.kept_bytes(), 6 * kMiB);
}

TEST(KeptBuffersTest, TheSmallestBufferThatFitsIsTaken) {
  KeptBuffers buffers(16 * kMiB);
  uint8_t* small = nullptr;
  uint8_t* large = nullptr;
  {
    const KeptBuffers::Lease a = buffers.Take(6 * kMiB);
    const KeptBuffers::Lease b = buffers.Take(2 * kMiB);
    large = a.data();
    small = b.data();
  }
  EXPECT_EQ(buffers.Take(kMiB).data(), small);
  EXPECT_EQ(buffers.Take(3 * kMiB).data(), large);
  // Neither holds 7 MiB: a new buffer, and both stay kept.
  {
    const KeptBuffers::Lease fresh = buffers.Take(7 * kMiB);
    EXPECT_NE(fresh.data(), small);
    EXPECT_NE(fresh.data(), large);
    EXPECT_EQ(buffers.kept_bytes(), 8 * kMiB);
  }
}

TEST(KeptBuffersTest, KeptBytesNeverPassTheBound) {
  KeptBuffers buffers(4 * kMiB);
  {
    const KeptBuffers::Lease a = buffers.Take(3 * kMiB);
    const KeptBuffers::Lease b = buffers.Take(3 * kMiB);
    const KeptBuffers::Lease too_large = buffers.Take(5 * kMiB);
  }
  // The 5 MiB buffer is freed (above the bound), one 3 MiB buffer kept, the other freed.
  EXPECT_EQ(buffers.kept_bytes(), 3 * kMiB);
  EXPECT_EQ(buffers.held_bytes(), 3 * kMiB);
}

// What the buffers hold in all, leased or kept, for the node's memory report.
TEST(KeptBuffersTest, HeldBytesCountLeasedAndKeptBuffers) {
  KeptBuffers buffers(4 * kMiB);
  {
    const KeptBuffers::Lease a = buffers.Take(3 * kMiB);
    const KeptBuffers::Lease b = buffers.Take(kMiB / 2);  // a granule: 1 MiB
    const KeptBuffers::Lease large = buffers.Take(5 * kMiB);
    EXPECT_EQ(buffers.kept_bytes(), 0u);
    EXPECT_EQ(buffers.held_bytes(), 9 * kMiB);
  }
  EXPECT_EQ(buffers.held_bytes(), 4 * kMiB);  // a and b kept; the large one freed
  const KeptBuffers::Lease again = buffers.Take(2 * kMiB);  // a's buffer, leased again
  EXPECT_EQ(buffers.kept_bytes(), kMiB);
  EXPECT_EQ(buffers.held_bytes(), 4 * kMiB);
}

TEST(KeptBuffersTest, ALargerBufferDisplacesSmallerOnes) {
  KeptBuffers buffers(3 * kMiB);
  uint8_t* larger = nullptr;
  {
    // Returned in the reverse order: b, a, then c.
    const KeptBuffers::Lease c = buffers.Take(3 * kMiB);
    const KeptBuffers::Lease a = buffers.Take(kMiB);
    const KeptBuffers::Lease b = buffers.Take(kMiB);
    larger = c.data();
  }
  // a and b were kept (2 MiB); c's 3 MiB fit only by freeing both.
  EXPECT_EQ(buffers.kept_bytes(), 3 * kMiB);
  EXPECT_EQ(buffers.Take(kMiB).data(), larger);
}

TEST(KeptBuffersTest, AMovedLeaseReturnsItsBufferOnce) {
  KeptBuffers buffers(8 * kMiB);
  {
    KeptBuffers::Lease a = buffers.Take(kMiB);
    KeptBuffers::Lease b = std::move(a);
    EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
    KeptBuffers::Lease c = buffers.Take(2 * kMiB);
    c = std::move(b);  // c's own buffer goes back now
    EXPECT_EQ(buffers.kept_bytes(), 2 * kMiB);
  }
  EXPECT_EQ(buffers.kept_bytes(), 3 * kMiB);
}

}  // namespace
}  // namespace moesnap::daemon::cluster
