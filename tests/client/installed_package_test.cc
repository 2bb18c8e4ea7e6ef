// The installed C++ package as a user meets it: `cmake --install --component client` into a fresh
// prefix, a trainer project configured and built outside this tree with find_package(moesnap)
// (C++ client and C ABI), a C trainer built with `pkg-config moesnap-c` alone, and each run against
// a real moesnapd: register, snapshot, commit, scribble, restore, compare every byte.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/testing/child_process.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using ::testing::HasSubstr;

struct Outcome {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

Outcome RunCommand(const std::vector<std::string>& argv,
                   const std::vector<std::string>& environment = {}) {
  testing::ChildProcess process(argv, environment, testing::ChildProcess::Stderr::kCapture);
  Outcome outcome;
  while (std::optional<std::string> line = process.ReadLine(std::chrono::minutes(3))) {
    absl::StrAppend(&outcome.output, *line, "\n");
  }
  outcome.exit_code = process.Wait(std::chrono::minutes(1)).value_or(-1);
  return outcome;
}

#define ASSERT_RUNS(outcome, what) \
  ASSERT_EQ((outcome).exit_code, 0) << what << " failed:\n" << (outcome).output

class InstalledPackageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (std::filesystem::temp_directory_path() / "moesnap-install-XXXXXX");
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    directory_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }

  std::filesystem::path directory_;
};

TEST_F(InstalledPackageTest, TrainersBuiltAgainstItRunAgainstADaemon) {
  const std::string prefix = directory_ / "prefix";
  const std::string build = directory_ / "build";
  ASSERT_RUNS(RunCommand({MOESNAP_CMAKE, "--install", MOESNAP_BUILD_DIR, "--component", "client",
                   "--prefix", prefix}),
              "cmake --install");
  for (const char* installed : {"include/moesnap/client.h", "include/moesnap/moesnap.h",
                                "lib/cmake/moesnap/moesnapConfig.cmake",
                                "lib/pkgconfig/moesnap.pc", "lib/libmoesnap.so.0",
                                "lib/libmoesnap_c.so.2"}) {
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(prefix) / installed)) << installed;
  }
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(prefix) / "bin"))
      << "the client component installs no programs";

  ASSERT_RUNS(RunCommand({MOESNAP_CMAKE, "-S", absl::StrCat(MOESNAP_SOURCE_DIR,
                                                     "/tests/client/installed_trainer"),
                   "-B", build, "-G", "Ninja", absl::StrCat("-DCMAKE_PREFIX_PATH=", prefix)}),
              "configuring the trainer with find_package(moesnap)");
  ASSERT_RUNS(RunCommand({MOESNAP_CMAKE, "--build", build}), "building the trainer");

  // The C trainer again, with nothing but the compiler and pkg-config.
  const std::string pkg_config_path = absl::StrCat("PKG_CONFIG_PATH=", prefix, "/lib/pkgconfig");
  const Outcome flags = RunCommand({MOESNAP_PKG_CONFIG, "--cflags", "--libs", "moesnap-c"},
                            {pkg_config_path});
  ASSERT_RUNS(flags, "pkg-config moesnap-c");
  EXPECT_THAT(flags.output, HasSubstr(absl::StrCat("-L", prefix, "/lib")));
  const Outcome cxx_flags = RunCommand({MOESNAP_PKG_CONFIG, "--cflags", "--libs", "moesnap"},
                                {pkg_config_path});
  ASSERT_RUNS(cxx_flags, "pkg-config moesnap");
  EXPECT_THAT(cxx_flags.output, HasSubstr("-lmoesnap "));
  EXPECT_THAT(cxx_flags.output, HasSubstr("-labsl_statusor"));
  const std::string pkg_config_trainer = directory_ / "pkg_config_trainer";
  ASSERT_RUNS(RunCommand({"/bin/sh", "-c",
                   absl::StrCat(MOESNAP_C_COMPILER, " ", MOESNAP_SOURCE_DIR,
                                "/tests/client/installed_trainer/trainer.c -o ",
                                pkg_config_trainer, " $(", MOESNAP_PKG_CONFIG,
                                " --cflags --libs moesnap-c) -Wl,-rpath,", prefix, "/lib")},
                  {pkg_config_path}),
              "compiling with pkg-config moesnap-c");

  testing::TestDaemon daemon({.pool_bytes = "64MiB"});
  ASSERT_TRUE(daemon.Start());
  const std::vector<std::string> trainers = {build + "/cpp_trainer", build + "/c_trainer",
                                             pkg_config_trainer};
  for (size_t rank = 0; rank < trainers.size(); ++rank) {
    const Outcome trained =
        RunCommand({trainers[rank], daemon.agent_socket(), std::to_string(rank)});
    ASSERT_RUNS(trained, trainers[rank]);
    EXPECT_THAT(trained.output, HasSubstr("restored step 1\n")) << trainers[rank];
  }
}

}  // namespace
}  // namespace moesnap
