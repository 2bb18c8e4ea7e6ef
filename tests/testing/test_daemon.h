// A real moesnapd for integration tests: its own config, sockets in a fresh temporary folder and a
// pool name of its own, started as a child process and killed for real. The pool files are removed
// when the TestDaemon is destroyed, not when the process dies: restarts re-attach them.
#ifndef MOESNAP_TESTS_TESTING_TEST_DAEMON_H_
#define MOESNAP_TESTS_TESTING_TEST_DAEMON_H_

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tests/testing/child_process.h"

namespace moesnap::testing {

// What a TestDaemon's generated config says.
struct TestDaemonOptions {
  std::string pool_bytes = "768MiB";
  std::string journal_bytes = "1MiB";
  std::string pool_lock = "off";  // [pool] lock: off, so tests need no locked-memory allowance
  int capture_threads = 2;
  uint32_t node_id = 0;
  int agent_max_threads = 0;  // [agent] max_threads; 0: the daemon's default
  std::string extra_config = "";  // appended to the TOML (tables must not repeat generated ones)
};

class TestDaemon {
 public:
  explicit TestDaemon(const TestDaemonOptions& options = {});
  ~TestDaemon();

  // Starts moesnapd and waits until it serves (its admin service answers, from this process).
  // False if it exited (three times, each with another HTTP port) or never served. An
  // `environment` that sets a MOESNAP_CRASH_* or MOESNAP_REBUILD_HOLD_* variable runs
  // moesnapd-faults, the test build that alone honours them.
  bool Start(const std::vector<std::string>& environment = {});
  // The same with `program` (moesnapd or moesnapd-faults) whatever the environment.
  bool StartProgram(const std::string& program, const std::vector<std::string>& environment);
  // Starts later daemons with `launcher` before the program's command line (e.g. NetLab::Launch's
  // prefix, to run it on a host of a network lab).
  void set_launcher(std::vector<std::string> launcher) { launcher_ = std::move(launcher); }
  int Kill(int signal);
  // SIGSTOP, waiting until the process is stopped; SIGCONT.
  bool Pause();
  void Resume();
  // Deletes the pool and journal files (after a kill), so the next Start is a replacement node
  // with fresh memory.
  void DiscardPool();
  // Waits for the daemon to exit on its own: its exit code, -signal, or nullopt on timeout.
  std::optional<int> WaitExit(std::chrono::milliseconds timeout) {
    return process_ ? process_->Wait(timeout) : std::nullopt;
  }
  bool running() { return process_ && process_->running(); }
  pid_t pid() const { return process_ ? process_->pid() : -1; }

  const std::string& agent_socket() const { return agent_socket_; }
  const std::string& admin_socket() const { return admin_socket_; }
  const std::string& config_path() const { return config_path_; }
  const std::string& directory() const { return directory_; }
  const std::string& pool_name() const { return pool_name_; }
  // Where it serves /metrics, /healthz and /readyz on 127.0.0.1.
  uint16_t http_port() const { return http_port_; }

 private:
  // Picks another HTTP port and writes it into the config.
  void MoveHttpPort();

  std::string directory_;
  std::string config_path_;
  std::string agent_socket_;
  std::string admin_socket_;
  std::string pool_name_;
  uint16_t http_port_ = 0;
  std::vector<std::string> launcher_;
  std::unique_ptr<ChildProcess> process_;
};

// A program of this build (build/bin), or of $MOESNAP_BIN_DIR when set.
std::string BinaryPath(const std::string& program);

}  // namespace moesnap::testing

#endif  // MOESNAP_TESTS_TESTING_TEST_DAEMON_H_
