#include "tests/testing/test_daemon.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "common/loopback_port.h"
#include "proto/moesnap.grpc.pb.h"

namespace moesnap::testing {
namespace {

// True once the daemon process `pid` answers operators: every socket is bound and served then.
// A socket that accepts connections is not enough: the agent socket listens a moment before the
// admin socket is bound, and a killed daemon's socket files stay behind.
bool Serves(const std::string& admin_socket, pid_t pid) {
  auto stub = v1::Admin::NewStub(
      grpc::CreateChannel("unix:" + admin_socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::StatusResponse status;
  return stub->Status(&context, v1::StatusRequest(), &status).ok() &&
         static_cast<pid_t>(status.pid()) == pid;
}

}  // namespace

std::string BinaryPath(const std::string& program) {
  // MOESNAP_BIN_DIR overrides the build's folder, for programs run from a bundle elsewhere.
  const char* directory = std::getenv("MOESNAP_BIN_DIR");
  return absl::StrCat(directory != nullptr ? directory : MOESNAP_BIN_DIR, "/", program);
}

TestDaemon::TestDaemon(const TestDaemonOptions& options) {
  static std::atomic<int> counter{0};
  char directory[] = "/tmp/moesnap-test-XXXXXX";
  directory_ = mkdtemp(directory);
  // The temporary folder's random part too: a pool left by a daemon a test killed must never be
  // found again by a later test process that got the same pid.
  pool_name_ = absl::StrCat("moesnap-test-", getpid(), "-", counter++, "-",
                            directory_.substr(directory_.rfind('-') + 1));
  agent_socket_ = directory_ + "/agent.sock";
  admin_socket_ = directory_ + "/admin.sock";
  config_path_ = directory_ + "/moesnapd.toml";
  http_port_ = UnusedLoopbackPort();
  std::ofstream(config_path_) << absl::StrCat(
      "[node]\nid = ", options.node_id, "\n[agent]\nsocket = \"", agent_socket_, "\"\n",
      options.agent_max_threads > 0 ? absl::StrCat("max_threads = ", options.agent_max_threads, "\n")
                                    : "",
      "[admin]\nsocket = \"", admin_socket_, "\"\n[http]\naddress = \"127.0.0.1:", http_port_,
      "\"\n[pool]\nname = \"", pool_name_, "\"\nbytes = \"", options.pool_bytes,
      "\"\njournal_bytes = \"", options.journal_bytes, "\"\nlock = \"", options.pool_lock,
      "\"\n[capture]\nthreads = ", options.capture_threads, "\n", options.extra_config);
}

TestDaemon::~TestDaemon() {
  process_.reset();
  DiscardPool();
  std::filesystem::remove_all(directory_);
}

void TestDaemon::DiscardPool() {
  for (const char* suffix : {".data", ".journal"}) {
    std::filesystem::remove("/dev/shm/" + pool_name_ + suffix);
  }
}

bool TestDaemon::Start(const std::vector<std::string>& environment) {
  const bool injects_faults =
      std::any_of(environment.begin(), environment.end(), [](const std::string& variable) {
        return variable.rfind("MOESNAP_CRASH_", 0) == 0 ||
               variable.rfind("MOESNAP_REBUILD_HOLD_", 0) == 0;
      });
  return StartProgram(injects_faults ? "moesnapd-faults" : "moesnapd", environment);
}

bool TestDaemon::StartProgram(const std::string& program,
                              const std::vector<std::string>& environment) {
  // The HTTP port was free when it was picked, but another process may have bound it since: the
  // daemon then exits at start, before its admin socket serves (it binds every port first), and
  // gets another port, twice at most. Its admin socket answering with its pid means it started.
  for (int start = 0; start < 3; ++start) {
    if (start > 0) MoveHttpPort();
    std::vector<std::string> argv = launcher_;
    argv.insert(argv.end(), {BinaryPath(program), "--config", config_path_});
    process_ = std::make_unique<ChildProcess>(argv, environment);
    for (int attempt = 0; attempt < 1000; ++attempt) {
      if (Serves(admin_socket_, process_->pid())) return true;
      if (!process_->running()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (process_->running()) return false;  // never served
  }
  return false;
}

void TestDaemon::MoveHttpPort() {
  std::ifstream in(config_path_);
  std::string config((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string old_address = absl::StrCat("127.0.0.1:", http_port_);
  http_port_ = UnusedLoopbackPort();
  if (const size_t at = config.find(old_address); at != std::string::npos) {
    config.replace(at, old_address.size(), absl::StrCat("127.0.0.1:", http_port_));
  }
  std::ofstream(config_path_) << config;
}

int TestDaemon::Kill(int signal) { return process_ ? process_->Kill(signal) : 0; }

bool TestDaemon::Pause() {
  if (!running()) return false;
  process_->Signal(SIGSTOP);
  for (int attempt = 0; attempt < 5000; ++attempt) {
    if (process_->stopped()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

void TestDaemon::Resume() {
  if (process_) process_->Signal(SIGCONT);
}

}  // namespace moesnap::testing
