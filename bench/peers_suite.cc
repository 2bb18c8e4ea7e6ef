// The peers suite: a real PyTorch state checkpointed with moesnap and with torch.save, in one run.
// The measuring is bench/peers.py under the Debian interpreter that has torch; this suite starts
// the daemon it talks to and turns its lines into records. Ratios are figure / baseline (times:
// below 1 means moesnap blocks or recovers faster).
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/suites.h"
#include "daemon/daemon.h"

namespace moesnap::bench {

absl::Status RunPeersSuite(Report& report) {
  if (access(MOESNAP_PYTHON, X_OK) != 0) {
    return absl::UnavailableError(absl::StrCat(MOESNAP_PYTHON, " (with torch) is not installed"));
  }
  const std::string directory = absl::StrCat("/tmp/moesnap-bench-peers-", getpid());
  std::filesystem::create_directories(directory);
  daemon::DaemonOptions options;
  options.agent_socket = directory + "/agent.sock";
  options.admin_socket = directory + "/admin.sock";
  options.pool.name = absl::StrCat("moesnap-bench-peers-", getpid());
  options.pool.bytes = uint64_t{2} << 30;
  options.pool.journal_bytes = 1 << 20;
  options.pool.lock = daemon::PoolLockMode::kOff;
  absl::Status status;
  {
    absl::StatusOr<std::unique_ptr<daemon::Daemon>> daemon = daemon::Daemon::Start(options);
    if (!daemon.ok()) return daemon.status();
    const std::string command =
        absl::StrCat("PYTHONPATH=", MOESNAP_PYTHON_PACKAGE_DIR, " ", MOESNAP_PYTHON, " ",
                     MOESNAP_SOURCE_DIR, "/bench/peers.py --socket ", options.agent_socket);
    FILE* output = popen(command.c_str(), "r");
    if (output == nullptr) return absl::InternalError("cannot run bench/peers.py");
    char line[1024];
    int records = 0;
    while (fgets(line, sizeof(line), output) != nullptr) {
      std::vector<std::string> fields = absl::StrSplit(absl::StripTrailingAsciiWhitespace(line), '|');
      double value = 0, baseline = 0;
      if (fields.size() != 5 || !absl::SimpleAtod(fields[1], &value) ||
          !absl::SimpleAtod(fields[4], &baseline)) {
        continue;
      }
      report.Add({"peers", fields[0], value, fields[2], fields[3], baseline, value / baseline});
      ++records;
    }
    const int exit = pclose(output);
    if (exit != 0 || records == 0) {
      status = absl::InternalError(absl::StrCat("bench/peers.py failed (exit ", exit, ")"));
    }
  }
  for (const char* suffix : {".data", ".journal"}) {
    std::filesystem::remove("/dev/shm/" + options.pool.name + suffix);
  }
  std::filesystem::remove_all(directory);
  if (!status.ok()) return status;
  report.AddNote("peers",
                 "One process, one state: 16 expert-shaped Linear pairs (256 MiB of fp32 weights) "
                 "with Adam moments, 768 MiB in all, moved into shared memory by the moesnap "
                 "package. Snapshot() is the trainer's blocking time (the copy then runs while the "
                 "next step computes); torch.save blocks for its whole write. Best of 3 for "
                 "torch.save/load, median of 5 Snapshot() calls; the disk load reads the page "
                 "cache, a lower bound of a real recovery from disk.");
  return absl::OkStatus();
}

}  // namespace moesnap::bench
