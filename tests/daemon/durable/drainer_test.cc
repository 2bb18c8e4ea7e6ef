// The drain against a fake store, view and clock: due steps become complete steps on disk, a
// commit never waits for a drain (a step due meanwhile is skipped and counted), retention keeps K
// and the newest step durable on every node, and failures are reported, not raised.
#include "daemon/durable/drainer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/daemon/durable/fakes.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::durable {
namespace {

class DrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char root[] = "/tmp/moesnap-drainer-XXXXXX";
    options_.directory = mkdtemp(root);
    options_.every_steps = 2;
    options_.keep = 2;
  }
  void TearDown() override {
    drainer_.reset();
    std::filesystem::remove_all(options_.directory);
  }
  void Start() {
    drainer_ = std::make_unique<Drainer>(options_, StepIdentity{1, 0, {}, 1}, &store_, &view_, &clock_);
    drainer_->Start();
  }
  // Commits `step` (after step - 1) and waits for whatever drain it caused.
  void Commit(int64_t step) {
    store_.Commit(step - 1, step, MakeImage(pool_.get(), {{0, "weights", 20000}}, step, 4096, step));
    ASSERT_TRUE(drainer_->WaitIdle(absl::Now() + absl::Seconds(30)));
  }
  std::vector<int64_t> Steps() { return *drainer_->directory().Steps(); }

  DurableOptions options_;
  TestPool pool_;
  FakeDurableStore store_;
  FakeJobView view_;
  FakeClock clock_;
  std::unique_ptr<Drainer> drainer_;
};

TEST_F(DrainerTest, DueStepsBecomeDurableAndOnlyTheNewestKeepAreKept) {
  Start();
  for (int64_t step = 1; step <= 7; ++step) Commit(step);
  EXPECT_EQ(Steps(), std::vector<int64_t>({4, 6}));  // 2 and 4 and 6 drained, keep = 2
  const v1::DurableStatus status = drainer_->Status();
  EXPECT_EQ(status.latest_step(), 6);
  EXPECT_EQ(status.drains_completed(), 3u);
  EXPECT_EQ(status.drains_failed(), 0u);
  EXPECT_TRUE(status.last_error().empty());
  EXPECT_FALSE(status.has_draining_step());
}

TEST_F(DrainerTest, RetentionSparesTheNewestStepDurableOnEveryNode) {
  view_.everywhere = DurableEverywhere{2, "recorded by every node"};  // the others hold only 2
  Start();
  for (int64_t step = 1; step <= 7; ++step) Commit(step);
  EXPECT_EQ(Steps(), std::vector<int64_t>({2, 4, 6}));
  view_.everywhere = absl::UnavailableError("etcd down");  // unknown now: the last known stays spared
  Commit(8);
  EXPECT_EQ(Steps(), std::vector<int64_t>({2, 6, 8}));
}

TEST_F(DrainerTest, EveryCompletedDrainRecordsTheStepsOnDiskOnceAndAFailedRecordIsShown) {
  Start();
  for (int64_t step = 1; step <= 4; ++step) Commit(step);
  EXPECT_EQ(view_.Recorded(), std::vector<std::vector<int64_t>>({{2}, {2, 4}}));  // one per drain
  view_.record_failure = absl::UnavailableError("etcd cannot be reached");
  Commit(5);
  Commit(6);
  EXPECT_EQ(Steps(), std::vector<int64_t>({4, 6}));  // on disk, but not recorded
  EXPECT_EQ(view_.Recorded().size(), 2u);
  const v1::DurableStatus status = drainer_->Status();
  EXPECT_NE(status.last_error().find("could not be recorded"), std::string::npos)
      << status.last_error();
  EXPECT_NE(status.last_error().find("etcd cannot be reached"), std::string::npos)
      << status.last_error();
  view_.record_failure = absl::OkStatus();
  Commit(7);
  Commit(8);
  EXPECT_EQ(view_.Recorded().back(), std::vector<int64_t>({6, 8}));
  EXPECT_TRUE(drainer_->Status().last_error().empty());
}

TEST_F(DrainerTest, ACommitNeverWaitsForADrainAndADueStepMeanwhileIsSkipped) {
  options_.bytes_per_second = 1;  // every write sleeps on the fake clock, held by the test
  clock_.Hold(true);
  Start();
  store_.Commit(1, 2, MakeImage(pool_.get(), {{0, "weights", 20000}}, 2, 4096, 2));
  clock_.AwaitSleeper();  // the drain of step 2 is in the middle of its write
  const absl::Time before = absl::Now();
  store_.Commit(3, 4, MakeImage(pool_.get(), {{0, "weights", 20000}}, 4, 4096, 4));
  EXPECT_LT(absl::Now() - before, absl::Seconds(1));  // returned at once
  v1::DurableStatus status = drainer_->Status();
  EXPECT_EQ(status.draining_step(), 2);
  EXPECT_EQ(status.drains_skipped(), 1u);
  EXPECT_GT(status.draining_bytes(), 0u);
  EXPECT_TRUE(Steps().empty());  // nothing listed until complete
  clock_.Hold(false);
  ASSERT_TRUE(drainer_->WaitIdle(absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(Steps(), std::vector<int64_t>({2}));
}

TEST_F(DrainerTest, StoppingMidDrainRemovesThePartialStepAndKeepsTheOthers) {
  Start();
  Commit(2);
  drainer_.reset();
  options_.bytes_per_second = 1;
  clock_.Hold(true);
  Start();
  store_.Commit(3, 4, MakeImage(pool_.get(), {{0, "weights", 20000}}, 4, 4096, 4));
  clock_.AwaitSleeper();
  // The daemon stops while step 4 is half written: the drain is told to stop before it may go on.
  std::thread stopping([this] { drainer_.reset(); });
  while (store_.observed()) absl::SleepFor(absl::Milliseconds(1));
  clock_.Hold(false);
  stopping.join();
  const DurableDirectory directory(options_.directory, 1);
  EXPECT_EQ(*directory.Steps(), std::vector<int64_t>({2}));
  EXPECT_EQ(*directory.RemoveLeftovers(), 0);
}

TEST_F(DrainerTest, AFolderThatCannotBeUsedIsReportedAndCommitsGoOn) {
  std::filesystem::create_directories(options_.directory);
  std::ofstream(options_.directory + "/node-1") << "a file in the way";
  Start();
  EXPECT_NE(drainer_->Status().last_error().find("cannot be used"), std::string::npos)
      << drainer_->Status().last_error();
  Commit(2);
  const v1::DurableStatus status = drainer_->Status();
  EXPECT_EQ(status.drains_failed(), 1u);
  EXPECT_NE(status.last_error().find("drain of step 2"), std::string::npos) << status.last_error();
  EXPECT_NE(status.last_error().find("no step is durable yet"), std::string::npos);
  EXPECT_GT(status.last_error_unix_ms(), 0);
  // Fixed by the operator: the next due step drains.
  std::filesystem::remove(options_.directory + "/node-1");
  Commit(3);
  Commit(4);
  EXPECT_EQ(Steps(), std::vector<int64_t>({4}));
  EXPECT_TRUE(drainer_->Status().last_error().empty());
}

TEST_F(DrainerTest, DiscardAfterRemovesTheAbandonedRunsSteps) {
  options_.keep = 5;
  Start();
  for (int64_t step = 1; step <= 6; ++step) Commit(step);
  EXPECT_EQ(Steps(), std::vector<int64_t>({2, 4, 6}));
  ASSERT_OK(drainer_->DiscardAfter(2));
  EXPECT_EQ(Steps(), std::vector<int64_t>({2}));
  EXPECT_EQ(view_.Recorded().back(), std::vector<int64_t>({2}));  // the deletion is recorded
  EXPECT_EQ(drainer_->Status().latest_step(), 2);
}

}  // namespace
}  // namespace moesnap::daemon::durable
