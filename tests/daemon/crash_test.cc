// Failure semantics on one node, with real processes and real SIGKILL: a trainer killed at random
// points (mid-capture among them) and a daemon killed at random points (mid-journal-write among them)
// must leave the last committed step restorable, byte for byte.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdlib>
#include <random>
#include <string>

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
using namespace std::chrono_literals;

// 64 regions of 4 MiB: 256 MiB of state per trainer.
std::vector<std::string> TrainerArguments(const TestDaemon& daemon, const std::string& mode) {
  return {BinaryPath("moesnap-test-trainer"), "--socket", daemon.agent_socket(), "--mode", mode,
          "--regions", "64", "--region-bytes", "4194304", "--steps", "1000000"};
}

// Parses "<prefix><step>".
bool StepAfter(const std::string& line, const std::string& prefix, int64_t* step) {
  return absl::StartsWith(line, prefix) && absl::SimpleAtoi(line.substr(prefix.size()), step);
}

uint64_t Seed() {
  const char* fixed = std::getenv("MOESNAP_TEST_SEED");
  uint64_t seed = std::random_device{}();
  if (fixed != nullptr) {
    EXPECT_TRUE(absl::SimpleAtoi(fixed, &seed));
  }
  std::printf("MOESNAP_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

// Runs a verify trainer: restores the latest committed step and compares every byte.
int64_t VerifiedStep(const TestDaemon& daemon) {
  ChildProcess verify(TrainerArguments(daemon, "verify"));
  int64_t step = -1;
  while (std::optional<std::string> line = verify.ReadLine(60s)) {
    if (absl::StartsWith(*line, "restored ") || absl::StartsWith(*line, "tier ")) continue;
    if (!StepAfter(*line, "verified step ", &step)) {
      ADD_FAILURE() << "verify trainer: " << *line;
    }
  }
  EXPECT_EQ(verify.Wait(60s), 0) << "the restored bytes differ from the snapshotted ones";
  return step;
}

struct Progress {
  int64_t last_snapshot = 0;  // Snapshot returned
  int64_t last_captured = 0;  // WaitCaptured returned: committed on a single node
  int64_t restored = -1;      // the step the trainer restored at start, if any
};

// Reads trainer output until `lines` step lines have been seen or the trainer stops.
void Follow(ChildProcess& trainer, int lines, Progress& progress) {
  int seen = 0;
  while (seen < lines) {
    std::optional<std::string> line = trainer.ReadLine(60s);
    if (!line) return;
    int64_t step = 0;
    if (StepAfter(*line, "snapshot ", &step)) {
      progress.last_snapshot = step;
      ++seen;
    } else if (StepAfter(*line, "captured ", &step)) {
      progress.last_captured = step;
      ++seen;
    } else if (StepAfter(*line, "verified step ", &step)) {
      progress.restored = step;
    } else if (absl::StartsWith(*line, "restored ") || absl::StartsWith(*line, "tier ")) {
      continue;
    } else {
      return;  // an error line: the daemon went away
    }
  }
}

// Reads, to its end, what a killed trainer printed after Follow stopped reading: it ran on until
// the kill.
void ReadToTheEnd(ChildProcess& trainer, Progress& progress) {
  while (std::optional<std::string> line = trainer.ReadLine(10s)) {
    int64_t step = 0;
    if (StepAfter(*line, "snapshot ", &step)) {
      progress.last_snapshot = step;
    } else if (StepAfter(*line, "captured ", &step)) {
      progress.last_captured = step;
    }
  }
}

TEST(TrainerCrashTest, KilledAtRandomPointsRestoresTheLastCommittedStepExactly) {
  std::mt19937_64 random(Seed());
  TestDaemon daemon;
  ASSERT_TRUE(daemon.Start());
  int64_t committed = 0;
  for (int round = 0; round < 20; ++round) {
    ChildProcess trainer(TrainerArguments(daemon, "train"));
    Progress progress;
    // Even rounds stop right after a "snapshot" line, with the copy of that step in flight.
    const int lines = 2 * static_cast<int>(random() % 4) + (round % 2 == 0 ? 1 : 2);
    Follow(trainer, lines, progress);
    trainer.Kill(SIGKILL);
    ASSERT_EQ(progress.restored, round == 0 ? -1 : committed) << "round " << round;
    ASSERT_GT(progress.last_snapshot, committed) << "round " << round << " made no progress";

    // The daemon finishes a capture whose trainer died: the restored step is the last snapshot
    // (or the next one, if the kill landed between Snapshot returning and the line being printed).
    committed = VerifiedStep(daemon);
    EXPECT_GE(committed, progress.last_snapshot) << "round " << round;
    EXPECT_LE(committed, progress.last_snapshot + 1) << "round " << round;
    EXPECT_GE(committed, progress.last_captured);
  }
  EXPECT_TRUE(daemon.running());
}

v1::StatusResponse AdminStatus(const TestDaemon& daemon) {
  auto stub = v1::Admin::NewStub(
      grpc::CreateChannel("unix:" + daemon.admin_socket(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 10s);
  v1::StatusResponse response;
  EXPECT_TRUE(stub->Status(&context, v1::StatusRequest(), &response).ok());
  return response;
}

v1::VerifyResponse AdminVerify(const TestDaemon& daemon) {
  auto stub = v1::Admin::NewStub(
      grpc::CreateChannel("unix:" + daemon.admin_socket(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 60s);
  v1::VerifyResponse response;
  EXPECT_TRUE(stub->Verify(&context, v1::VerifyRequest(), &response).ok());
  return response;
}

TEST(DaemonCrashTest, KilledAtRandomPointsRestartsToTheLastCommittedStep) {
  std::mt19937_64 random(Seed());
  TestDaemon daemon;
  int64_t committed = 0;
  for (int round = 0; round < 10; ++round) {
    // Every third round the daemon kills itself half-way through a journal write.
    const bool in_journal_write = round % 3 == 2;
    std::vector<std::string> environment;
    if (in_journal_write) {
      ASSERT_TRUE(daemon.Start());
      const int64_t sequence = AdminStatus(daemon).journal_sequence();
      daemon.Kill(SIGTERM);
      environment.push_back(absl::StrCat("MOESNAP_CRASH_IN_JOURNAL_WRITE=",
                                         sequence + 2 + static_cast<int64_t>(random() % 4)));
    }
    ASSERT_TRUE(daemon.Start(environment)) << "round " << round;

    ChildProcess trainer(TrainerArguments(daemon, "train"));
    Progress progress;
    if (in_journal_write) {
      Follow(trainer, 1000, progress);  // until the daemon dies under it
      ASSERT_EQ(daemon.WaitExit(30s), -SIGKILL) << "the injected crash did not happen";
    } else {
      Follow(trainer, 2 + static_cast<int>(random() % 8), progress);
      std::this_thread::sleep_for(std::chrono::milliseconds(random() % 40));
      daemon.Kill(SIGKILL);
    }
    trainer.Kill(SIGKILL);
    // The trainer went on between the lines followed and the daemon's kill.
    ReadToTheEnd(trainer, progress);
    EXPECT_EQ(progress.restored, round == 0 ? -1 : committed) << "round " << round;

    ASSERT_TRUE(daemon.Start()) << "the daemon did not come back after round " << round;
    const v1::VerifyResponse verify = AdminVerify(daemon);
    EXPECT_EQ(verify.corruptions_size(), 0) << "round " << round;
    EXPECT_EQ(verify.versions_checked(), 64u);
    committed = VerifiedStep(daemon);
    // Every step the trainer saw captured was committed before WaitCaptured returned; none it did
    // not take is (one more than its last line when the kill landed between Snapshot returning and
    // the line being printed).
    EXPECT_GE(committed, progress.last_captured) << "round " << round;
    EXPECT_LE(committed, progress.last_snapshot + 1) << "round " << round;
    daemon.Kill(SIGKILL);
  }
}

}  // namespace
}  // namespace moesnap
