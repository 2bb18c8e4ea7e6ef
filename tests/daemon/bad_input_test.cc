// Bad input against a real moesnapd: each mistake gets an error that names what was wrong, and the
// state already committed stays restorable, byte for byte.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cstring>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "moesnap/client.h"
#include "tests/testing/child_process.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::TestDaemon;
using testing::TestDaemonOptions;
using namespace std::chrono_literals;

constexpr size_t kRegionBytes = 1 << 20;

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(daemon_.Start());
    ASSERT_NO_FATAL_FAILURE(Connect(client_, buffer_));
    for (size_t i = 0; i < kRegionBytes; ++i) buffer_->data()[i] = static_cast<uint8_t>(i * 7 + 1);
    ASSERT_OK(client_->Snapshot(1));
    ASSERT_OK(client_->WaitCommitted(1));
  }

  // A client with region "weights" of kRegionBytes registered.
  void Connect(std::unique_ptr<Client>& client, std::shared_ptr<SharedBuffer>& buffer,
               size_t bytes = kRegionBytes) {
    absl::StatusOr<std::unique_ptr<Client>> connected =
        Client::Connect({.socket_path = daemon_.agent_socket(), .rank = 0});
    ASSERT_OK(connected);
    client = *std::move(connected);
    absl::StatusOr<std::shared_ptr<SharedBuffer>> allocated = client->AllocateHost(bytes);
    ASSERT_OK(allocated);
    buffer = *allocated;
    ASSERT_OK(client->RegisterHostRegion({"weights", "uint8", {static_cast<int64_t>(bytes)}},
                                         buffer, 0, bytes));
  }

  // A fresh trainer process's view: restore step 1 into new memory and compare.
  void ExpectStepOneIntact() {
    std::unique_ptr<Client> client;
    std::shared_ptr<SharedBuffer> buffer;
    ASSERT_NO_FATAL_FAILURE(Connect(client, buffer));
    absl::StatusOr<RestoreResult> restored = client->Restore();
    ASSERT_OK(restored);
    EXPECT_EQ(restored->step, 1);
    for (size_t i = 0; i < kRegionBytes; ++i) {
      ASSERT_EQ(buffer->data()[i], static_cast<uint8_t>(i * 7 + 1)) << "byte " << i;
    }
  }

  static void ExpectError(const absl::Status& status, absl::StatusCode code,
                          const std::string& mentions) {
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), mentions))
        << "'" << status.message() << "' does not mention '" << mentions << "'";
  }

  TestDaemon daemon_{{.pool_bytes = "16MiB"}};
  std::unique_ptr<Client> client_;
  std::shared_ptr<SharedBuffer> buffer_;
};

TEST_F(BadInputTest, UnknownRegionIsNamed) {
  ExpectError(client_->Snapshot(2, {"weights", "layer9.missing"}).status(),
              absl::StatusCode::kNotFound, "layer9.missing");
  ExpectError(client_->Restore(std::nullopt, {"layer9.missing"}).status(),
              absl::StatusCode::kNotFound, "layer9.missing");
  ExpectStepOneIntact();
}

TEST_F(BadInputTest, RestoreIntoARegionOfAnotherSizeNamesBothSizes) {
  std::unique_ptr<Client> client;
  std::shared_ptr<SharedBuffer> buffer;
  ASSERT_NO_FATAL_FAILURE(Connect(client, buffer, kRegionBytes + 4));
  ExpectError(client->Restore().status(), absl::StatusCode::kInvalidArgument,
              "region 'weights' is 1048580 bytes in this trainer, but step 1 stored 1048576");
  ExpectStepOneIntact();
}

TEST_F(BadInputTest, StepNotAfterTheLatestIsRefused) {
  ExpectError(client_->Snapshot(1).status(), absl::StatusCode::kInvalidArgument,
              "step 1 of rank 0 is not after step 1");
  ExpectError(client_->Restore(0).status(), absl::StatusCode::kFailedPrecondition,
              "only the latest committed step, 1, is kept");
  ExpectStepOneIntact();
}

// Steps are 0 to 2^62. Before the bound, a step past it was captured (and, committed, overflowed
// the upstream log's pruning at INT64_MAX), and a window starting at INT64_MAX overflowed the
// daemon's check of the slot's step.
TEST_F(BadInputTest, StepsAndWindowsPastTheBoundAreRefusedNamingIt) {
  constexpr int64_t kPastTheBound = (int64_t{1} << 62) + 1;
  ExpectError(client_->Snapshot(kPastTheBound).status(), absl::StatusCode::kInvalidArgument,
              "step is 4611686018427387905; steps are 0 to 4611686018427387904");
  ExpectError(client_->Snapshot(-5).status(), absl::StatusCode::kInvalidArgument,
              "step is -5; steps are 0 to");
  ExpectError(client_->WaitCommitted(std::numeric_limits<int64_t>::max()),
              absl::StatusCode::kInvalidArgument, "steps are 0 to");
  ExpectError(client_->SnapshotSparse(2, {"weights"},
                                      {std::numeric_limits<int64_t>::max(), 4, 1, 0, {}})
                  .status(),
              absl::StatusCode::kInvalidArgument,
              "the window's first step is 9223372036854775807; steps are 0 to");
  // A trainer that named its steps right goes on.
  ASSERT_OK(client_->Snapshot(2));
  ASSERT_OK(client_->WaitCommitted(2));
}

TEST_F(BadInputTest, SnapshotLargerThanThePoolIsSkippedSayingHowMuchMoreIsNeeded) {
  // A 16 MiB pool holds step 1 (1 MiB); a 20 MiB region cannot fit. That is no error of the
  // trainer's: the step is skipped, the trainer goes on, and the reason names the shortfall.
  absl::StatusOr<std::shared_ptr<SharedBuffer>> big = client_->AllocateHost(20 << 20);
  ASSERT_OK(big);
  ASSERT_OK(client_->RegisterHostRegion({"huge", "uint8", {}}, *big, 0, 20 << 20));
  absl::StatusOr<uint64_t> copied = client_->Snapshot(2);
  ASSERT_OK(copied);
  EXPECT_EQ(*copied, 0u);
  std::vector<std::pair<int64_t, std::string>> skipped = client_->TakeSkippedSteps();
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].first, 2);
  EXPECT_TRUE(absl::StrContains(skipped[0].second, "needs 22020096 bytes")) << skipped[0].second;
  // The step as a whole: 21 MiB against the 15 MiB free.
  EXPECT_TRUE(absl::StrContains(skipped[0].second, "6291456 more")) << skipped[0].second;
  // A later step naming only "weights" takes "huge" along (step 2 changed it and stored nothing),
  // so it cannot fit either; the committed step 1 was never touched.
  ASSERT_OK(client_->Snapshot(3, {"weights"}));
  skipped = client_->TakeSkippedSteps();
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].first, 3);
  EXPECT_TRUE(absl::StrContains(skipped[0].second, "pool")) << skipped[0].second;
  ExpectStepOneIntact();
}

TEST_F(BadInputTest, MalformedConfigNamesTheKeyAndTheFile) {
  const std::string path = daemon_.directory() + "/bad.toml";
  for (const auto& [text, mentions] : std::vector<std::pair<std::string, std::string>>{
           {"[pool]\nbytes = \"12 parsecs\"\n", "pool.bytes"},
           {"[pool]\nsize = 5\n", "unknown key pool.size"},
           {"[capture]\nthreads = 0\n", "capture.threads"},
           {"[pool\n", "bad.toml:"}}) {
    std::ofstream(path) << text;
    ChildProcess daemon({BinaryPath("moesnapd"), "--config", path}, {},
                        ChildProcess::Stderr::kCapture);
    std::string output;
    while (std::optional<std::string> line = daemon.ReadLine(10s)) output += *line;
    EXPECT_EQ(daemon.Wait(10s), 2) << text;
    EXPECT_TRUE(absl::StrContains(output, mentions)) << output;
    EXPECT_TRUE(absl::StrContains(output, path)) << output;
  }
  ExpectStepOneIntact();
}

TEST_F(BadInputTest, AFileTruncatedUnderTheCopyFailsTheStepAndTheDaemonServesOn) {
  // An unsealed file, as PyTorch's shared storages are: the trainer can shrink it at any time.
  constexpr size_t kFileBytes = 4 << 20;
  const int fd = memfd_create("unsealed-region", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, kFileBytes), 0);
  absl::StatusOr<std::vector<MemoryHandle>> shared = client_->ShareMemory({fd});
  ASSERT_OK(shared);
  ASSERT_OK(client_->RegisterHostRegions(
      {{{"optimizer", "uint8", {kFileBytes}}, (*shared)[0], 0, kFileBytes}}));
  ASSERT_EQ(ftruncate(fd, 4096), 0);  // every page of the region but the first is gone

  ASSERT_OK(client_->Snapshot(2));
  const absl::Status captured = client_->WaitCommitted(2);
  ExpectError(captured, absl::StatusCode::kFailedPrecondition, "truncated under the copy");
  EXPECT_TRUE(daemon_.running());

  ASSERT_EQ(ftruncate(fd, kFileBytes), 0);  // back to its size: the next step captures it
  ASSERT_OK(client_->Snapshot(3));
  ASSERT_OK(client_->WaitCommitted(3));
  close(fd);
}

TEST_F(BadInputTest, OverlongRegionDescriptionsAreRefusedNamingTheLimit) {
  const std::string long_name(5000, 'n');
  ExpectError(client_->RegisterHostRegion({long_name, "uint8", {64}}, buffer_, 0, 64),
              absl::StatusCode::kInvalidArgument, "at most 1024");
  ExpectError(client_->RegisterHostRegion({"bias", std::string(100, 'd'), {64}}, buffer_, 0, 64),
              absl::StatusCode::kInvalidArgument, "dtype of 100 bytes; at most 64");
  ExpectError(client_->RegisterHostRegion({"bias", "uint8", std::vector<int64_t>(65, 1)}, buffer_,
                                          0, 64),
              absl::StatusCode::kInvalidArgument, "65 dimensions; at most 64");
  ExpectStepOneIntact();
}

TEST_F(BadInputTest, SecondDaemonOnTheSameSocketOrPoolIsRefused) {
  ChildProcess second({BinaryPath("moesnapd"), "--config", daemon_.config_path()}, {},
                      ChildProcess::Stderr::kCapture);
  std::string output;
  while (std::optional<std::string> line = second.ReadLine(10s)) output += *line;
  EXPECT_EQ(second.Wait(10s), 1);
  EXPECT_TRUE(absl::StrContains(output, "in use by another moesnapd")) << output;

  // Another pool but the same sockets: refused at the socket, naming it.
  std::ifstream original(daemon_.config_path());
  std::string config((std::istreambuf_iterator<char>(original)), std::istreambuf_iterator<char>());
  const size_t name = config.find(daemon_.pool_name());
  config.replace(name, daemon_.pool_name().size(), daemon_.pool_name() + "-other");
  const std::string other_config = daemon_.directory() + "/other.toml";
  std::ofstream(other_config) << config;
  ChildProcess third({BinaryPath("moesnapd"), "--config", other_config}, {},
                     ChildProcess::Stderr::kCapture);
  output.clear();
  while (std::optional<std::string> line = third.ReadLine(10s)) output += *line;
  EXPECT_EQ(third.Wait(10s), 1);
  EXPECT_TRUE(absl::StrContains(output, "already serving " + daemon_.agent_socket())) << output;
  for (const char* suffix : {".data", ".journal"}) {
    std::remove(("/dev/shm/" + daemon_.pool_name() + "-other" + suffix).c_str());
  }
  EXPECT_TRUE(daemon_.running());
  ExpectStepOneIntact();
}

// A daemon whose HTTP port is taken exits naming it, never says it serves, and leaves neither
// sockets nor a pool behind.
TEST_F(BadInputTest, ADaemonWhoseHttpPortIsTakenExitsNamingItAndLeavesNoPool) {
  TestDaemon other(TestDaemonOptions{.pool_bytes = "16MiB"});
  std::ifstream original(other.config_path());
  std::string config((std::istreambuf_iterator<char>(original)), std::istreambuf_iterator<char>());
  const std::string own = absl::StrCat("127.0.0.1:", other.http_port());
  const std::string taken = absl::StrCat("127.0.0.1:", daemon_.http_port());
  const size_t at = config.find(own);
  ASSERT_NE(at, std::string::npos) << config;
  config.replace(at, own.size(), taken);
  std::ofstream(other.config_path(), std::ios::trunc) << config;
  ChildProcess process({BinaryPath("moesnapd"), "--config", other.config_path()}, {},
                       ChildProcess::Stderr::kCapture);
  std::string output;
  while (std::optional<std::string> line = process.ReadLine(10s)) output += *line + "\n";
  EXPECT_EQ(process.Wait(10s), 1);
  EXPECT_TRUE(absl::StrContains(output, "cannot serve HTTP on " + taken + " (http.address)"))
      << output;
  EXPECT_FALSE(absl::StrContains(output, "serving trainers")) << output;
  EXPECT_FALSE(std::filesystem::exists(other.admin_socket()));
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + other.pool_name() + ".data"));
  EXPECT_TRUE(daemon_.running());
  ExpectStepOneIntact();
}

TEST_F(BadInputTest, PeerWithoutCredentialsIsRefusedByName) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another user";
  // Open the socket's file permissions, as a misconfiguration would: the credential check must still
  // refuse a user who is neither root, the daemon's uid, in its group, nor listed.
  ASSERT_EQ(chmod(daemon_.agent_socket().c_str(), 0666), 0);
  ASSERT_EQ(chmod(daemon_.directory().c_str(), 0755), 0);
  ChildProcess stranger({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                         BinaryPath("moesnap-test-trainer"), "--socket", daemon_.agent_socket(),
                         "--regions", "1", "--region-bytes", "4096", "--mode", "verify"});
  std::string output;
  while (std::optional<std::string> line = stranger.ReadLine(20s)) output += *line;
  EXPECT_EQ(stranger.Wait(10s), 3);
  EXPECT_TRUE(absl::StrContains(output, "PERMISSION_DENIED")) << output;
  EXPECT_TRUE(absl::StrContains(output, "accepts root and uid")) << output;
  ExpectStepOneIntact();
}

// MOESNAP_CRASH_IN_JOURNAL_WRITE kills the test build of the daemon at its first journal write; the
// production daemon has no such code and trains on.
TEST(FaultInjectionTest, OnlyTheTestBuildOfTheDaemonHonoursTheCrashVariables) {
  const std::vector<std::string> crash = {"MOESNAP_CRASH_IN_JOURNAL_WRITE=1"};
  auto train = [](TestDaemon& daemon) {
    ChildProcess trainer({BinaryPath("moesnap-test-trainer"), "--socket", daemon.agent_socket(),
                          "--regions", "1", "--region-bytes", "4096", "--steps", "3"});
    while (trainer.ReadLine(30s)) {
    }
    return trainer.Wait(30s);
  };
  {
    TestDaemon test_build{{.pool_bytes = "16MiB"}};
    ASSERT_TRUE(test_build.StartProgram("moesnapd-faults", crash));
    train(test_build);
    EXPECT_EQ(test_build.WaitExit(30s), -SIGKILL);
  }
  TestDaemon production{{.pool_bytes = "16MiB"}};
  ASSERT_TRUE(production.StartProgram("moesnapd", crash));
  EXPECT_EQ(train(production), 0);
  EXPECT_TRUE(production.running());
}

}  // namespace
}  // namespace moesnap
