// The durable tier against a real moesnapd and trainer, killed for real: a pool lost with its
// daemon restores the newest durable step byte for byte; a daemon SIGKILLed in the middle of a
// drain leaves the previous step restorable and no partial step listed; a full disk and a folder
// that cannot be written stop the drains but never the training, and status says why.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "proto/moesnap.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::TestDaemon;
using testing::TestDaemonOptions;
using namespace std::chrono_literals;

constexpr int kRegions = 4;

struct Restored {
  int64_t step = -1;
  std::string tier;
};

class DurableTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char root[] = "/tmp/moesnap-durable-tier-XXXXXX";
    root_ = mkdtemp(root);
  }
  void TearDown() override {
    daemon_.reset();
    if (!mount_point_.empty()) umount2(mount_point_.c_str(), MNT_DETACH);
    for (const auto& entry : std::filesystem::recursive_directory_iterator(root_)) {
      chmod(entry.path().c_str(), 0700);
    }
    std::filesystem::remove_all(root_);
  }

  // Trains to each step of `steps` in turn, waiting after each for it to be durable, so that no
  // drain is still writing when the next one comes due. (The first step committed after a start
  // is always due.)
  void DrainEach(const std::vector<int64_t>& steps) {
    for (int64_t step : steps) {
      TrainTo(step);
      ASSERT_NO_FATAL_FAILURE(WaitDurable(step));
    }
  }

  void StartDaemon(const std::string& durable_keys, const std::string& root = "") {
    daemon_ = std::make_unique<TestDaemon>(TestDaemonOptions{
        .pool_bytes = "128MiB",
        .extra_config = absl::StrCat("[durable]\ndirectory = \"", root.empty() ? root_ : root,
                                     "\"\n", durable_keys)});
    ASSERT_TRUE(daemon_->Start());
  }

  // Kills the daemon (its trainer is gone too) and, with `lose_pool`, its memory: a power loss.
  void Restart(bool lose_pool) {
    daemon_->Kill(SIGKILL);
    daemon_->WaitExit(10s);
    if (lose_pool) daemon_->DiscardPool();
    ASSERT_TRUE(daemon_->Start());
  }

  std::vector<std::string> Trainer(const std::string& mode, int64_t steps) {
    return {BinaryPath("moesnap-test-trainer"), "--socket", daemon_->agent_socket(), "--rank", "0",
            "--mode", mode, "--regions", std::to_string(kRegions), "--region-bytes",
            std::to_string(region_bytes_), "--steps", std::to_string(steps)};
  }

  // Trains (resuming from whatever the daemon restores) up to `steps`; every step must go through.
  void TrainTo(int64_t steps) {
    ChildProcess trainer(Trainer("train", steps));
    std::string last;
    while (std::optional<std::string> line = trainer.ReadLine(120s)) last = *line;
    EXPECT_EQ(last, absl::StrCat("done ", steps));
    EXPECT_EQ(trainer.Wait(10s), 0);
  }

  // A fresh trainer restores and compares every byte with what the run snapshotted at that step.
  Restored Verify() {
    ChildProcess verify(Trainer("verify", 0));
    Restored restored;
    std::string output;
    while (std::optional<std::string> line = verify.ReadLine(120s)) {
      absl::StrAppend(&output, *line, "\n");
      if (absl::StartsWith(*line, "verified step ")) {
        EXPECT_TRUE(absl::SimpleAtoi(line->substr(14), &restored.step));
      }
      if (absl::StartsWith(*line, "tier ")) restored.tier = line->substr(5);
    }
    EXPECT_EQ(verify.Wait(10s), 0) << output;
    return restored;
  }

  std::unique_ptr<v1::Admin::Stub> Admin() {
    return v1::Admin::NewStub(grpc::CreateChannel("unix:" + daemon_->admin_socket(),
                                                  grpc::InsecureChannelCredentials()));
  }
  v1::DurableStatus Durable() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    v1::StatusResponse response;
    EXPECT_TRUE(Admin()->Status(&context, {}, &response).ok());
    return response.durable();
  }
  v1::ListDurableResponse List() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    v1::ListDurableResponse response;
    EXPECT_TRUE(Admin()->ListDurable(&context, {}, &response).ok());
    return response;
  }
  std::vector<int64_t> Listed() {
    std::vector<int64_t> steps;
    const v1::ListDurableResponse list = List();
    for (const v1::DurableStepInfo& step : list.steps()) steps.push_back(step.step());
    return steps;
  }
  // Waits until step `step` is complete on disk and no drain runs.
  void WaitDurable(int64_t step) {
    for (int attempt = 0; attempt < 600; ++attempt) {
      const v1::DurableStatus status = Durable();
      if (status.latest_step() >= step && !status.has_draining_step()) return;
      std::this_thread::sleep_for(50ms);
    }
    FAIL() << "step " << step << " did not become durable: " << Durable().DebugString();
  }
  // Waits until a drain has written part of step `step`.
  void WaitDraining(int64_t step) {
    for (int attempt = 0; attempt < 600; ++attempt) {
      const v1::DurableStatus status = Durable();
      if (status.draining_step() == step && status.draining_bytes_written() > 0) return;
      std::this_thread::sleep_for(20ms);
    }
    FAIL() << "no drain of step " << step << " started: " << Durable().DebugString();
  }

  std::string root_;
  std::string mount_point_;  // a file system the test mounted, unmounted at the end
  uint64_t region_bytes_ = 256 << 10;
  std::unique_ptr<TestDaemon> daemon_;
};

TEST_F(DurableTierTest, APoolLostWithItsDaemonRestoresTheNewestDurableStepExactly) {
  StartDaemon("every_steps = 2\nkeep = 2\n");
  ASSERT_NO_FATAL_FAILURE(DrainEach({1, 2, 4, 6}));
  TrainTo(7);
  EXPECT_EQ(Listed(), std::vector<int64_t>({4, 6}));
  EXPECT_EQ(Verify().tier, "memory");  // memory serves while it holds the state

  Restart(/*lose_pool=*/true);
  grpc::ClientContext context;
  v1::RestoreTierRequest request;
  v1::RestoreTierResponse tier;
  ASSERT_TRUE(Admin()->RestoreTier(&context, request, &tier).ok());
  EXPECT_EQ(tier.tier(), v1::TIER_DURABLE);
  EXPECT_EQ(tier.step(), 6);
  const Restored restored = Verify();
  EXPECT_EQ(restored.step, 6);
  EXPECT_EQ(restored.tier, "durable");

  // Training resumes from the durable step and the drains go on from there.
  TrainTo(9);
  ASSERT_NO_FATAL_FAILURE(WaitDurable(8));
  Restart(/*lose_pool=*/true);
  EXPECT_EQ(Verify().step, 8);
}

TEST_F(DurableTierTest, ADaemonKilledMidDrainLeavesThePreviousStepAndNoPartialOne) {
  region_bytes_ = 1 << 20;  // 4 MiB of state
  StartDaemon("every_steps = 2\nkeep = 3\n");
  ASSERT_NO_FATAL_FAILURE(DrainEach({1, 2}));
  // The same daemon, now writing at 1 MiB/s: the next drain takes about four seconds.
  daemon_->Kill(SIGTERM);
  daemon_->WaitExit(10s);
  std::ofstream(daemon_->config_path(), std::ios::app) << "bytes_per_second = \"1MiB\"\n";
  ASSERT_TRUE(daemon_->Start());
  ChildProcess trainer(Trainer("train", 4));
  ASSERT_NO_FATAL_FAILURE(WaitDraining(4));
  daemon_->Kill(SIGKILL);  // in the middle of writing step 4
  trainer.Wait(30s);
  bool partial = false;
  for (const auto& entry : std::filesystem::directory_iterator(root_ + "/node-0")) {
    partial |= absl::StartsWith(entry.path().filename().string(), ".partial-step-4");
  }
  EXPECT_TRUE(partial) << "the drain of step 4 was not interrupted mid-write";
  daemon_->DiscardPool();
  ASSERT_TRUE(daemon_->Start());
  EXPECT_EQ(Listed(), std::vector<int64_t>({1, 2}));
  const Restored restored = Verify();
  EXPECT_EQ(restored.step, 2);
  EXPECT_EQ(restored.tier, "durable");
  for (const auto& entry : std::filesystem::directory_iterator(root_ + "/node-0")) {
    EXPECT_TRUE(absl::StartsWith(entry.path().filename().string(), "step-"))
        << entry.path() << " was left behind";  // the leftover is cleared at start
  }
}

TEST_F(DurableTierTest, AFullDiskStopsTheDrainsNotTheTrainingAndStatusSaysWhy) {
  if (geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs to fill needs root";
  ASSERT_EQ(mount("tmpfs", root_.c_str(), "tmpfs", 0, "size=2560k"), 0) << std::strerror(errno);
  mount_point_ = root_;
  // 1 MiB per step; steps 1 and 2 fit, and a third never does while both are kept.
  StartDaemon("every_steps = 2\nkeep = 2\n");
  ASSERT_NO_FATAL_FAILURE(DrainEach({1, 2}));
  TrainTo(7);  // steps 4 and 6 are due and fail
  WaitDurable(2);
  const v1::DurableStatus status = Durable();
  EXPECT_EQ(status.latest_step(), 2);
  EXPECT_GE(status.drains_failed(), 1u);  // step 6 may have come due while step 4 was failing
  EXPECT_TRUE(absl::StrContains(status.last_error(), "No space left on device")) << status.last_error();
  EXPECT_TRUE(absl::StrContains(status.last_error(), "step 2 stays the newest durable step"))
      << status.last_error();
  ChildProcess ctl({BinaryPath("moesnapctl"), "--socket", daemon_->admin_socket(), "status"});
  std::string output;
  while (std::optional<std::string> line = ctl.ReadLine(30s)) absl::StrAppend(&output, *line, "\n");
  EXPECT_TRUE(absl::StrContains(output, "FAILING: drain of step")) << output;
  EXPECT_EQ(Listed(), std::vector<int64_t>({1, 2}));
  Restart(/*lose_pool=*/true);
  EXPECT_EQ(Verify().step, 2);  // the previous durable step is intact
}

TEST_F(DurableTierTest, AFolderThatCannotBeWrittenStopsTheDrainsNotTheTraining) {
  const std::string root = root_ + "/durable";
  std::filesystem::create_directory(root);
  if (geteuid() == 0) {  // root writes through file modes: make the file system read-only
    ASSERT_EQ(mount("tmpfs", root.c_str(), "tmpfs", MS_RDONLY, "size=1m"), 0) << std::strerror(errno);
    mount_point_ = root;
  } else {
    ASSERT_EQ(chmod(root.c_str(), 0500), 0);
  }
  StartDaemon("every_steps = 2\n", root);
  TrainTo(5);
  const v1::DurableStatus status = Durable();
  EXPECT_FALSE(status.has_latest_step());
  EXPECT_GE(status.drains_failed(), 1u);
  EXPECT_TRUE(absl::StrContains(status.last_error(), "Read-only file system") ||
              absl::StrContains(status.last_error(), "Permission denied"))
      << status.last_error();
  EXPECT_TRUE(absl::StrContains(status.last_error(), "no step is durable yet")) << status.last_error();
  EXPECT_EQ(Verify().step, 5);  // memory still serves
}

}  // namespace
}  // namespace moesnap
