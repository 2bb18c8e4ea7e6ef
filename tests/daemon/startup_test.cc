// moesnapd's start as an operator meets it: a bad config is refused with every error listed and
// nothing created; a start that fails after the pool was created removes the fresh pool again.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/testing/child_process.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using namespace std::chrono_literals;

struct DaemonRun {
  std::optional<int> exit_code;
  std::string output;
};

// Runs moesnapd on `config` text, with `flags`, until it exits.
DaemonRun RunDaemon(const std::string& directory, const std::string& config,
                    const std::vector<std::string>& flags = {}) {
  const std::string path = directory + "/moesnapd.toml";
  std::ofstream(path) << config;
  std::vector<std::string> argv = {BinaryPath("moesnapd"), "--config", path};
  argv.insert(argv.end(), flags.begin(), flags.end());
  ChildProcess daemon(argv, {}, ChildProcess::Stderr::kCapture);
  DaemonRun run;
  while (std::optional<std::string> line = daemon.ReadLine(30s)) run.output += *line + "\n";
  run.exit_code = daemon.Wait(30s);
  return run;
}

class StartupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char directory[] = "/tmp/moesnap-startup-XXXXXX";
    directory_ = mkdtemp(directory);
    pool_name_ = absl::StrCat("moesnap-startup-", getpid());
  }
  void TearDown() override {
    std::filesystem::remove_all(directory_);
    for (const char* suffix : {".data", ".journal"}) {
      std::filesystem::remove("/dev/shm/" + pool_name_ + suffix);
    }
  }
  bool PoolExists() const {
    return std::filesystem::exists("/dev/shm/" + pool_name_ + ".data") ||
           std::filesystem::exists("/dev/shm/" + pool_name_ + ".journal");
  }
  std::string Sockets(const std::string& admin_directory) const {
    return absl::StrCat("[agent]\nsocket = \"", directory_, "/agent.sock\"\n[admin]\nsocket = \"",
                        admin_directory, "/admin.sock\"\n[http]\naddress = \"127.0.0.1:0\"\n"
                        "[pool]\nname = \"", pool_name_,
                        "\"\nbytes = \"16MiB\"\njournal_bytes = \"1MiB\"\nlock = \"off\"\n");
  }

  std::string directory_;
  std::string pool_name_;
};

TEST_F(StartupTest, APoolFileSomeoneElseCreatedIsRefusedAndKept) {
  // Planted under the pool's name before the daemon starts, readable by everyone.
  const std::string planted = "/dev/shm/" + pool_name_ + ".data";
  const int fd = open(planted.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fchmod(fd, 0644), 0);
  ASSERT_EQ(ftruncate(fd, 16 << 20), 0);
  close(fd);
  const DaemonRun run = RunDaemon(directory_, Sockets(directory_));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, planted + " is a file owned by uid")) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "mode 0644")) << run.output;
  EXPECT_TRUE(std::filesystem::exists(planted));  // not the daemon's to remove
}

TEST_F(StartupTest, BadConfigListsEveryErrorAndCreatesNothing) {
  const DaemonRun run = RunDaemon(
      directory_, Sockets(directory_) +
                      "[capture]\nthreads = 0\n[cluster]\ndata_units = 1\nparity_units = 1\n"
                      "node_count = 3\n");
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "capture.threads")) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "3 nodes cannot form groups of k + m = 2")) << run.output;
  EXPECT_FALSE(PoolExists());
}

TEST_F(StartupTest, FailedStartRemovesTheFreshPool) {
  // Valid config, but the admin socket's folder does not exist: binding fails after the pool and
  // journal were created.
  const DaemonRun run = RunDaemon(directory_, Sockets(directory_ + "/missing"));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "missing/admin.sock")) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "created pool")) << run.output;  // it got that far
  EXPECT_FALSE(PoolExists());
}

TEST_F(StartupTest, CheckConfigValidatesWithoutStartingAndNodeIdReplacesTheFiles) {
  // No etcd behind the endpoint: --check-config reaches nothing.
  const std::string cluster =
      "[cluster]\ndata_units = 1\nparity_units = 1\nnode_count = 2\n"
      "etcd_endpoints = [\"127.0.0.1:1\"]\nadvertise_host = \"127.0.0.1\"\n[tls]\ninsecure = true\n";
  const DaemonRun valid =
      RunDaemon(directory_, Sockets(directory_) + cluster, {"--check-config", "--node-id", "1"});
  EXPECT_EQ(valid.exit_code, 0) << valid.output;
  EXPECT_TRUE(absl::StrContains(valid.output, "moesnapd.toml: valid")) << valid.output;
  EXPECT_FALSE(PoolExists());
  const DaemonRun stranger =
      RunDaemon(directory_, Sockets(directory_) + cluster, {"--check-config", "--node-id", "9"});
  EXPECT_EQ(stranger.exit_code, 2) << stranger.output;
  EXPECT_TRUE(absl::StrContains(stranger.output, "node id 9 is not below cluster.node_count = 2"))
      << stranger.output;
}

}  // namespace
}  // namespace moesnap
