// RunPythonScript: a daemon in this process (unless the script starts its own), the script under
// popen, its lines parsed.
#include "bench/python_script.h"

#include <stdio.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/daemon.h"

namespace moesnap::bench {
namespace {

// Runs bench/<script.file> with `arguments` and adds the figures and notes it prints.
absl::Status RunAndParse(const PythonScript& script, const std::string& arguments,
                         Report& report) {
  const std::string command =
      absl::StrCat("PYTHONPATH=", MOESNAP_PYTHON_PACKAGE_DIR, " ", MOESNAP_PYTHON, " ",
                   MOESNAP_SOURCE_DIR, "/bench/", script.file, " ", arguments);
  FILE* output = popen(command.c_str(), "r");
  if (output == nullptr) {
    return absl::InternalError(absl::StrCat("cannot run bench/", script.file));
  }
  char line[4096];
  int records = 0;
  while (fgets(line, sizeof(line), output) != nullptr) {
    const absl::string_view text = absl::StripTrailingAsciiWhitespace(line);
    if (absl::StartsWith(text, "note|")) {
      report.AddNote(script.suite, std::string(text.substr(5)));
      continue;
    }
    std::vector<std::string> fields = absl::StrSplit(text, '|');
    double value = 0, baseline = 0;
    if (fields.size() != 5 || !absl::SimpleAtod(fields[1], &value) ||
        !absl::SimpleAtod(fields[4], &baseline)) {
      continue;
    }
    report.Add({script.suite, fields[0], value, fields[2], fields[3], baseline, value / baseline});
    ++records;
  }
  const int exit = pclose(output);
  if (exit != 0 || records == 0) {
    return absl::InternalError(
        absl::StrCat("bench/", script.file, " failed (exit ", exit, ", ", records, " figures)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunPythonScript(const PythonScript& script, Report& report) {
  if (access(MOESNAP_PYTHON, X_OK) != 0) {
    return absl::UnavailableError(absl::StrCat(MOESNAP_PYTHON, " (with torch) is not installed"));
  }
  if (script.own_daemons) return RunAndParse(script, "--bin-dir " MOESNAP_BIN_DIR, report);
  const std::string name = absl::StrCat("moesnap-bench-", script.suite, "-", getpid());
  const std::string directory = "/tmp/" + name;
  std::filesystem::create_directories(directory);
  daemon::DaemonOptions options;
  options.agent_socket = directory + "/agent.sock";
  options.admin_socket = directory + "/admin.sock";
  options.http.address = "";  // a benchmark serves no metrics
  options.pool.name = name;
  options.pool.bytes = script.pool_bytes;
  options.pool.journal_bytes = 1 << 20;
  options.pool.lock = daemon::PoolLockMode::kOff;
  absl::Status status;
  {
    absl::StatusOr<std::unique_ptr<daemon::Daemon>> daemon = daemon::Daemon::Start(options);
    if (!daemon.ok()) return daemon.status();
    status = RunAndParse(script, "--socket " + options.agent_socket, report);
  }
  for (const char* suffix : {".data", ".journal"}) {
    std::filesystem::remove("/dev/shm/" + options.pool.name + suffix);
  }
  std::filesystem::remove_all(directory);
  return status;
}

}  // namespace moesnap::bench
