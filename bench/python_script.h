// Suites whose measuring is a Python script of bench/ under the Debian interpreter that has torch:
// this starts the moesnapd the script talks to, in this process, runs the script with the package
// built into <build>/python, and turns the lines it prints into records and notes.
#ifndef MOESNAP_BENCH_PYTHON_SCRIPT_H_
#define MOESNAP_BENCH_PYTHON_SCRIPT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "bench/report.h"

namespace moesnap::bench {

struct PythonScript {
  std::string suite;        // the records and notes go under this suite
  std::string file;         // in bench/, e.g. "peers.py"; it gets --socket AGENT_SOCKET
  uint64_t pool_bytes = 0;  // the daemon's snapshot pool
  // The script starts its own daemons (a cluster of moesnapd processes it can SIGKILL): no daemon
  // in this process, and the script gets --bin-dir (where moesnapd and moesnapctl are) instead.
  bool own_daemons = false;
};

// The script prints "name|value|unit|baseline|baseline_value" per figure (ratio = value / baseline)
// and "note|text" per note; other lines are ignored. UNAVAILABLE without the interpreter; INTERNAL
// when the script exits non-zero or prints no figure (its stderr goes to this process's stderr).
// The daemon's pool and sockets are removed afterwards.
absl::Status RunPythonScript(const PythonScript& script, Report& report);

}  // namespace moesnap::bench

#endif  // MOESNAP_BENCH_PYTHON_SCRIPT_H_
