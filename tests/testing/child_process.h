// Real child processes for integration tests: start a program with arguments and environment, read
// its stdout line by line with a timeout, kill it with a real signal, and collect its exit status.
#ifndef MOESNAP_TESTS_TESTING_CHILD_PROCESS_H_
#define MOESNAP_TESTS_TESTING_CHILD_PROCESS_H_

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace moesnap::testing {

class ChildProcess {
 public:
  enum class Stderr { kPassThrough, kCapture };
  // Starts `argv[0]` with `argv`; `environment` entries ("NAME=value") are added to ours. stdout is
  // captured; stderr goes to the test's stderr (so daemon logs show up in failing test output), or
  // into the captured stream with kCapture.
  ChildProcess(const std::vector<std::string>& argv,
               const std::vector<std::string>& environment = {},
               Stderr stderr_mode = Stderr::kPassThrough);
  ~ChildProcess();  // SIGKILLs the child if it still runs
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  // The next line of stdout, without its newline; nullopt at end of output or after `timeout`.
  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout);
  // Sends `signal`, then waits for the exit; returns the wait status.
  int Kill(int signal);
  // Sends `signal` and returns (SIGSTOP, SIGCONT).
  void Signal(int signal);
  // Whether the process is stopped (by SIGSTOP), as /proc says.
  bool stopped() const;
  // Waits up to `timeout` for the exit; returns the exit code, or -signal if killed, or nullopt.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  bool running();

 private:
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  std::string buffer_;
  std::optional<int> exit_status_;
};

}  // namespace moesnap::testing

#endif  // MOESNAP_TESTS_TESTING_CHILD_PROCESS_H_
