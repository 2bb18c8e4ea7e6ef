// SharedBuffer's pages: huge ones where asked for, free and worth it (a file rounded up to whole
// pages), ordinary ones otherwise, and MOESNAP_HUGE_PAGES read as 1, 0 or unset only. The huge-page
// cases reserve pages as root (vm.nr_hugepages, put back after), holding the huge_pages lock.
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <stdlib.h>
#include <sys/vfs.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "moesnap/shared_buffer.h"
#include "tests/testing/huge_pages.h"
#include "tests/testing/status_matchers.h"

namespace moesnap {
namespace {

using Pages = SharedBuffer::Pages;
using testing::HugePageReservation;

constexpr size_t kMiB = size_t{1} << 20;

bool OnHugetlbfs(const SharedBuffer& buffer) {
  struct statfs file_system {};
  return fstatfs(buffer.fd(), &file_system) == 0 &&
         static_cast<uint64_t>(file_system.f_type) == HUGETLBFS_MAGIC;
}

bool AllZero(const SharedBuffer& buffer) {
  return std::all_of(buffer.data(), buffer.data() + buffer.file_bytes(),
                     [](uint8_t byte) { return byte == 0; });
}

class HugePagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<HugePageReservation>> reserved =
        HugePageReservation::ReserveForTest(kPages);
    if (!reserved.ok()) GTEST_SKIP() << reserved.status();
    reservation_ = *std::move(reserved);
    page_ = HugePageReservation::PageBytes();
  }

  static constexpr uint64_t kPages = 24;
  std::unique_ptr<HugePageReservation> reservation_;
  size_t page_ = 0;
};

TEST_F(HugePagesTest, ALargeBufferIsHeldInWholeHugePages) {
  const size_t bytes = 16 * kMiB + 100;
  absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer =
      SharedBuffer::Allocate(bytes, SharedBuffer::kRegionFile, Pages::kHuge);
  ASSERT_OK(buffer);
  EXPECT_TRUE(OnHugetlbfs(**buffer));
  EXPECT_EQ((*buffer)->page_bytes(), page_);
  EXPECT_EQ((*buffer)->size(), bytes);
  EXPECT_EQ((*buffer)->file_bytes(), (bytes + page_ - 1) / page_ * page_);
  EXPECT_TRUE(AllZero(**buffer));
  std::memset((*buffer)->data(), 0x5a, (*buffer)->file_bytes());
  EXPECT_EQ((*buffer)->data()[(*buffer)->file_bytes() - 1], 0x5a);
  // Exactly one huge page is held in one, whatever its size.
  absl::StatusOr<std::shared_ptr<SharedBuffer>> one_page =
      SharedBuffer::Allocate(page_, SharedBuffer::kRegionFile, Pages::kHuge);
  ASSERT_OK(one_page);
  EXPECT_TRUE(OnHugetlbfs(**one_page));
  EXPECT_EQ((*one_page)->file_bytes(), page_);
}

TEST_F(HugePagesTest, ABufferThatRoundingWouldGrowByMoreThanAnEighthKeepsOrdinaryPages) {
  for (const size_t bytes : {size_t{8}, page_ + page_ / 2, 3 * page_ + page_ / 8}) {
    absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer =
        SharedBuffer::Allocate(bytes, SharedBuffer::kRegionFile, Pages::kHuge);
    ASSERT_OK(buffer);
    EXPECT_FALSE(OnHugetlbfs(**buffer)) << bytes;
    EXPECT_EQ((*buffer)->file_bytes(), bytes);
    EXPECT_LT((*buffer)->page_bytes(), page_);
  }
}

TEST_F(HugePagesTest, TooFewFreeHugePagesLeaveABufferInOrdinaryPages) {
  const uint64_t free = HugePageReservation::FreePages();
  // It takes every free huge page for a moment: not where an operator reserved many.
  if (free > 4 * kPages) GTEST_SKIP() << free << " huge pages are free: too many to take them all";
  absl::StatusOr<std::shared_ptr<SharedBuffer>> all =
      SharedBuffer::Allocate(free * page_, SharedBuffer::kRegionFile, Pages::kHuge);
  ASSERT_OK(all);
  ASSERT_TRUE(OnHugetlbfs(**all));
  EXPECT_EQ(HugePageReservation::FreePages(), 0u);
  absl::StatusOr<std::shared_ptr<SharedBuffer>> more =
      SharedBuffer::Allocate(4 * page_, SharedBuffer::kRegionFile, Pages::kHuge);
  ASSERT_OK(more);
  EXPECT_FALSE(OnHugetlbfs(**more));
  EXPECT_EQ((*more)->file_bytes(), 4 * page_);
  EXPECT_TRUE(AllZero(**more));
  // Once pages are free again, they are used again.
  all->reset();
  absl::StatusOr<std::shared_ptr<SharedBuffer>> again =
      SharedBuffer::Allocate(4 * page_, SharedBuffer::kRegionFile, Pages::kHuge);
  ASSERT_OK(again);
  EXPECT_TRUE(OnHugetlbfs(**again));
}

TEST_F(HugePagesTest, TheEnvironmentAsksForHugePagesWithOneOnly) {
  absl::Cleanup unset = [] { unsetenv(SharedBuffer::kHugePagesVariable); };
  auto on_hugetlbfs = [&](const char* value) {
    if (value == nullptr) {
      unsetenv(SharedBuffer::kHugePagesVariable);
    } else {
      setenv(SharedBuffer::kHugePagesVariable, value, 1);
    }
    absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = SharedBuffer::Allocate(4 * page_);
    EXPECT_OK(buffer);
    return buffer.ok() && OnHugetlbfs(**buffer);
  };
  EXPECT_TRUE(on_hugetlbfs("1"));
  EXPECT_FALSE(on_hugetlbfs("0"));
  EXPECT_FALSE(on_hugetlbfs(""));
  EXPECT_FALSE(on_hugetlbfs(nullptr));
  // An explicit choice wins over the environment.
  setenv(SharedBuffer::kHugePagesVariable, "1", 1);
  absl::StatusOr<std::shared_ptr<SharedBuffer>> ordinary =
      SharedBuffer::Allocate(4 * page_, SharedBuffer::kRegionFile, Pages::kOrdinary);
  ASSERT_OK(ordinary);
  EXPECT_FALSE(OnHugetlbfs(**ordinary));
}

TEST(SharedBufferTest, AMistypedHugePagesSettingIsRefusedNamingIt) {
  absl::Cleanup unset = [] { unsetenv(SharedBuffer::kHugePagesVariable); };
  for (const char* value : {"yes", "2", "true"}) {
    setenv(SharedBuffer::kHugePagesVariable, value, 1);
    absl::StatusOr<int> file = SharedBuffer::CreateFile(kMiB);
    ASSERT_FALSE(file.ok()) << value;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(file.status().message(), "MOESNAP_HUGE_PAGES is '"))
        << file.status();
  }
}

TEST(SharedBufferTest, OrdinaryPagesHoldExactlyTheBytesAskedFor) {
  absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer =
      SharedBuffer::Allocate(3 * kMiB + 5, SharedBuffer::kRegionFile, Pages::kOrdinary);
  ASSERT_OK(buffer);
  EXPECT_FALSE(OnHugetlbfs(**buffer));
  EXPECT_EQ((*buffer)->size(), 3 * kMiB + 5);
  EXPECT_EQ((*buffer)->file_bytes(), 3 * kMiB + 5);
  EXPECT_TRUE(AllZero(**buffer));
}

}  // namespace
}  // namespace moesnap
