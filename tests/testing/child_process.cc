#include "tests/testing/child_process.h"

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace moesnap::testing {
namespace {
int DecodeStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return -1000;
}
}  // namespace

ChildProcess::ChildProcess(const std::vector<std::string>& argv,
                           const std::vector<std::string>& environment, Stderr stderr_mode) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) throw std::runtime_error("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  if (stderr_mode == Stderr::kCapture) {
    posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDERR_FILENO);
  }
  posix_spawn_file_actions_addclose(&actions, pipe_fds[0]);
  std::vector<char*> arguments;
  for (const std::string& argument : argv) arguments.push_back(const_cast<char*>(argument.c_str()));
  arguments.push_back(nullptr);
  std::vector<std::string> variables;
  for (char** entry = environ; *entry != nullptr; ++entry) variables.emplace_back(*entry);
  variables.insert(variables.end(), environment.begin(), environment.end());
  std::vector<char*> environment_pointers;
  for (std::string& variable : variables) environment_pointers.push_back(variable.data());
  environment_pointers.push_back(nullptr);
  const int error = posix_spawn(&pid_, arguments[0], &actions, nullptr, arguments.data(),
                                environment_pointers.data());
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  if (error != 0) {
    close(pipe_fds[0]);
    throw std::runtime_error("cannot start " + argv[0]);
  }
  stdout_fd_ = pipe_fds[0];
}

ChildProcess::~ChildProcess() {
  if (running()) Kill(SIGKILL);
  if (stdout_fd_ >= 0) close(stdout_fd_);
}

std::optional<std::string> ChildProcess::ReadLine(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (const size_t newline = buffer_.find('\n'); newline != std::string::npos) {
      std::string line = buffer_.substr(0, newline);
      buffer_.erase(0, newline + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    pollfd watched{stdout_fd_, POLLIN, 0};
    if (poll(&watched, 1, static_cast<int>(left.count())) <= 0) continue;
    char chunk[4096];
    const ssize_t got = read(stdout_fd_, chunk, sizeof(chunk));
    if (got <= 0) return std::nullopt;  // end of output
    buffer_.append(chunk, static_cast<size_t>(got));
  }
}

int ChildProcess::Kill(int signal) {
  if (exit_status_) return *exit_status_;
  kill(pid_, signal);
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  exit_status_ = DecodeStatus(status);
  return *exit_status_;
}

void ChildProcess::Signal(int signal) {
  if (!exit_status_) kill(pid_, signal);
}

bool ChildProcess::stopped() const {
  std::ifstream stat("/proc/" + std::to_string(pid_) + "/stat");
  const std::string contents((std::istreambuf_iterator<char>(stat)),
                             std::istreambuf_iterator<char>());
  const size_t close_paren = contents.rfind(')');  // the state letter follows the name
  return close_paren != std::string::npos && close_paren + 2 < contents.size() &&
         contents[close_paren + 2] == 'T';
}

std::optional<int> ChildProcess::Wait(std::chrono::milliseconds timeout) {
  if (exit_status_) return exit_status_;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exit_status_ = DecodeStatus(status);
      return exit_status_;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return std::nullopt;
}

bool ChildProcess::running() {
  if (exit_status_ || pid_ <= 0) return false;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    exit_status_ = DecodeStatus(status);
    return false;
  }
  return true;
}

}  // namespace moesnap::testing
