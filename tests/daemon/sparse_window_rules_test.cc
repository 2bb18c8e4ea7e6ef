// SparseWindows in-process: which slots a rank's windows take (slot 0 in the buffer the committed
// window does not hold, once the open window has settled; later slots in order), how slots move a
// window to committed, how a failed slot keeps its window from committing, and what the journal
// keeps of them.
#include "daemon/sparse_windows.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/match.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

v1::SparseSlot Slot(int64_t first_step, uint32_t slot, uint32_t buffer, uint32_t size = 3) {
  v1::SparseSlot sparse;
  sparse.set_window_first_step(first_step);
  sparse.set_window_size(size);
  sparse.set_slot(slot);
  sparse.set_buffer(buffer);
  return sparse;
}

void ExpectRefused(const absl::Status& status, const std::string& mentions) {
  EXPECT_STATUS(status, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(status.message(), mentions)) << status;
}

// Adds and commits slots 0..size-1 of the window from `first` as steps first, first + 1, ...
void CommitWindow(SparseWindows& windows, int64_t first, uint32_t buffer, uint32_t size = 3) {
  for (uint32_t slot = 0; slot < size; ++slot) {
    const v1::SparseSlot sparse = Slot(first, slot, buffer, size);
    ASSERT_OK(windows.Check(0, first + slot, sparse));
    ASSERT_OK(windows.Add(first + slot, sparse, v1::STEP_STATE_CAPTURING));
    windows.Mark(first + slot, sparse, v1::STEP_STATE_CAPTURED);
    windows.Commit(first + slot, sparse);
  }
}

TEST(SparseWindowRulesTest, AWindowCommitsWithItsLastSlotAndItsBufferIsKeptUntilTheNextCommits) {
  SparseWindows windows;
  EXPECT_TRUE(windows.empty());
  ExpectRefused(windows.Check(0, 11, Slot(10, 1, 0)), "open window is none");
  CommitWindow(windows, 10, 0, 2);
  ASSERT_TRUE(windows.committed().has_value());
  EXPECT_EQ(windows.committed()->first_step(), 10);
  EXPECT_FALSE(windows.open().has_value());
  ExpectRefused(windows.Check(0, 12, Slot(12, 0, 0)), "holds the last committed window");
  const v1::SparseSlot first = Slot(12, 0, 1);
  ASSERT_OK(windows.Check(0, 12, first));
  ASSERT_OK(windows.Add(12, first, v1::STEP_STATE_CAPTURING));
  windows.Commit(12, first);
  EXPECT_EQ(windows.committed()->first_step(), 10) << "a window of 3 slots committed after 1";
  ASSERT_TRUE(windows.open().has_value());
  EXPECT_EQ(windows.open()->slots_size(), 1);
}

TEST(SparseWindowRulesTest, SlotsComeInOrderOfTheOpenWindowAndANewWindowWaitsForItsSlotsToSettle) {
  SparseWindows windows;
  const v1::SparseSlot zero = Slot(20, 0, 0);
  ASSERT_OK(windows.Add(20, zero, v1::STEP_STATE_CAPTURING));
  ExpectRefused(windows.Check(0, 22, Slot(20, 2, 0)), "the window's next slot is 1");
  ExpectRefused(windows.Check(0, 21, Slot(20, 1, 1)), "buffer 0)");
  ExpectRefused(windows.Check(0, 21, Slot(19, 1, 0)), "the one from step 20");
  EXPECT_OK(windows.Check(0, 21, Slot(20, 1, 0)));
  ExpectRefused(windows.Check(0, 21, Slot(21, 0, 1)), "WaitCommitted(20) first");
  windows.Commit(20, zero);
  EXPECT_OK(windows.Check(0, 21, Slot(21, 0, 1)));  // the open window is abandoned
  ASSERT_OK(windows.Add(21, Slot(21, 0, 1), v1::STEP_STATE_CAPTURING));
  EXPECT_EQ(windows.open()->first_step(), 21);
  EXPECT_FALSE(windows.Mark(20, zero, v1::STEP_STATE_ABORTED)) << "not of the open window";
}

TEST(SparseWindowRulesTest, AFailedSlotKeepsItsWindowFromCommittingAndTheFirstReasonIsKept) {
  SparseWindows windows;
  const v1::SparseSlot zero = Slot(30, 0, 0, 2), one = Slot(30, 1, 0, 2);
  ASSERT_OK(windows.Add(30, zero, v1::STEP_STATE_CAPTURING));
  ASSERT_OK(windows.Add(31, one, v1::STEP_STATE_CAPTURING));
  EXPECT_EQ(windows.FailureOf(one), "");
  windows.Fail(30, zero, "slot 0 (step 30) aborted: the pool is full");
  windows.Fail(31, one, "slot 1 (step 31) aborted: later");
  EXPECT_EQ(windows.FailureOf(one), "slot 0 (step 30) aborted: the pool is full");
  EXPECT_EQ(windows.FailureOf(Slot(40, 1, 0, 2)), "") << "another window's slot";
  windows.Commit(31, one);
  EXPECT_FALSE(windows.committed().has_value()) << "a window with an aborted slot committed";
  EXPECT_EQ(windows.Describe(7).rank(), 7u);
  EXPECT_EQ(windows.Describe(7).open_window().failure(), windows.FailureOf(one));
}

// A slot past the first is recorded only into the open window it continues: with no window open,
// or another one open, it is refused and nothing changes.
TEST(SparseWindowRulesTest, ASlotOfAWindowThatIsNotOpenIsRefusedAndChangesNothing) {
  SparseWindows windows;
  ExpectRefused(windows.Add(11, Slot(10, 1, 0), v1::STEP_STATE_ABORTED), "no window is open");
  EXPECT_TRUE(windows.empty());
  const v1::SparseSlot zero = Slot(20, 0, 0);
  ASSERT_OK(windows.Add(20, zero, v1::STEP_STATE_CAPTURING));
  ExpectRefused(windows.Add(22, Slot(21, 1, 0), v1::STEP_STATE_ABORTED), "the one from step 20");
  ExpectRefused(windows.Add(21, Slot(20, 1, 0, 4), v1::STEP_STATE_ABORTED), "3 steps");
  ExpectRefused(windows.Add(21, Slot(20, 1, 1), v1::STEP_STATE_ABORTED), "buffer 0");
  ASSERT_EQ(windows.open()->slots_size(), 1);
  EXPECT_EQ(windows.open()->first_step(), 20);
  EXPECT_OK(windows.Add(21, Slot(20, 1, 0), v1::STEP_STATE_CAPTURING));
}

TEST(SparseWindowRulesTest, TheJournalKeepsTheCommittedWindowAndTheOpenOnesCommittedSlots) {
  SparseWindows windows;
  CommitWindow(windows, 50, 0, 2);
  const v1::SparseSlot zero = Slot(52, 0, 1, 2), one = Slot(52, 1, 1, 2);
  ASSERT_OK(windows.Add(52, zero, v1::STEP_STATE_CAPTURING));
  windows.Commit(52, zero);
  ASSERT_OK(windows.Add(53, one, v1::STEP_STATE_CAPTURING));
  v1::JournalRank saved;
  windows.SaveTo(&saved);
  EXPECT_EQ(saved.committed_window().first_step(), 50);
  ASSERT_EQ(saved.open_window().slots_size(), 1) << "an uncommitted slot was journaled";
  EXPECT_EQ(saved.open_window().slots(0).step(), 52);
  const SparseWindows loaded = SparseWindows::LoadFrom(saved);
  EXPECT_EQ(loaded.committed()->first_step(), 50);
  EXPECT_EQ(loaded.open()->slots_size(), 1);
  EXPECT_OK(loaded.Check(0, 53, one));  // a recovered rank takes the window up after slot 0
  EXPECT_TRUE(SparseWindows::LoadFrom(v1::JournalRank()).empty());
}

}  // namespace
}  // namespace moesnap::daemon
