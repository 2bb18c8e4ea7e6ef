// The peers suite: a real PyTorch state checkpointed with moesnap and with torch.save, in one run.
// The measuring is bench/peers.py under the Debian interpreter that has torch; this suite starts
// the daemon it talks to and turns its lines into records. Ratios are figure / baseline (times:
// below 1 means moesnap blocks or recovers faster).
#include "bench/python_script.h"
#include "bench/suites.h"

namespace moesnap::bench {

absl::Status RunPeersSuite(Report& report) {
  if (absl::Status status = RunPythonScript(
          {.suite = "peers", .file = "peers.py", .pool_bytes = uint64_t{3} << 30}, report);
      !status.ok()) {
    return status;
  }
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
