// The sparse suite (issue #6): MoEtion sparse snapshots, first as the SparseSchedule of one node of
// a DeepSeek-MoE-16B-shaped job, then measured with a real daemon on the example MoE model (the
// measuring is bench/sparse.py). Rows, each beside its limit or peer measured in this run:
//   DeepSeek-MoE-16B parameters     counted from the published config, beside the published count
//   ... node share: window W        the schedule's window at the stated iteration time x the memcpy
//                                   bandwidth measured here, beside the least window any schedule
//                                   could have (dense full state / per-step budget, rounded up)
//   ... W=n: costliest / mean slot  bytes one step of the schedule copies, beside the dense full
//                                   state that a per-step dense snapshot copies
//   ... at memcpy                   the costliest slot and the dense state copied at the memcpy
//                                   bandwidth (the physical limit), beside the iteration time:
//                                   above 1, the trainer stalls for the excess at every step
//   example MoE ...: step bytes     sparse's mean and costliest step, beside a dense snapshot
//                                   every step and the mean of dense snapshots every W steps
//   example MoE ...: stall          time in snapshot() + wait_captured() per step, sparse beside
//                                   dense, each beside a training step without snapshots
//   example MoE ...: recovery       state lost mid-window and rebuilt up to the failure step:
//                                   sparse-to-dense replay of the last complete window and the
//                                   steps after it, beside dense snapshots every W steps (restore
//                                   and the steps after it; the copy landing at once, or W steps
//                                   later as at sparse's per-step budget) and a per-step restore
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/aligned_buffer.h"
#include "bench/modelled_job.h"
#include "bench/python_script.h"
#include "bench/suites.h"
#include "moesnap/sparse_schedule.h"

namespace moesnap::bench {
namespace {

using modelled_job::kEveryStepBytes;
using modelled_job::kFullStateBytesPerParameter;
using modelled_job::kIterationSeconds;
using modelled_job::kNodes;
using modelled_job::kPublishedParameters;
using modelled_job::kRoutedExperts;
using modelled_job::kWeightBytesPerParameter;
using modelled_job::NodeShare;

// The buffer of the memcpy limit: far beyond the last-level cache.
constexpr size_t kCopyBytes = size_t{512} << 20;

// One thread's memcpy of a large buffer, best of 5 after a warm-up: the host-copy limit.
double MemcpyBytesPerSecond() {
  AlignedBuffer source(kCopyBytes, 0x11), destination(kCopyBytes, 0);
  std::memcpy(destination.data(), source.data(), kCopyBytes);
  double best = 0;
  for (int repetition = 0; repetition < 5; ++repetition) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(destination.data(), source.data(), kCopyBytes);
    // The destination is never read: keep the compiler from dropping the copy.
    asm volatile("" : : "r"(destination.data()) : "memory");
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, kCopyBytes / seconds);
  }
  return best;
}

absl::Status AddScheduleRows(Report& report) {
  const NodeShare table = modelled_job::NodeShareOfTheJob();
  const double copy_bytes_per_second = MemcpyBytesPerSecond();
  absl::StatusOr<SparseSchedule> schedule = SparseSchedule::Build(
      table.operators, {.iteration_seconds = kIterationSeconds,
                        .copy_bytes_per_second = copy_bytes_per_second,
                        .every_step_bytes = kEveryStepBytes});
  if (!schedule.ok()) return schedule.status();

  uint64_t dense = kEveryStepBytes;
  for (const Operator& op : table.operators) dense += op.full_state_bytes;
  uint64_t costliest = 0, total = 0;
  for (const Slot& slot : schedule->slots()) {
    costliest = std::max(costliest, slot.bytes);
    total += slot.bytes;
  }
  const double mean = static_cast<double>(total) / schedule->window();
  const double budget = static_cast<double>(schedule->budget_bytes());
  const double least_window = std::ceil(dense / budget);
  const double parameters = table.node_parameters * kNodes;  // every node's share is the same size
  const std::string node = absl::StrCat("DeepSeek-MoE-16B W=", schedule->window(), ": ");

  report.Add({"sparse", "DeepSeek-MoE-16B parameters, from its config", parameters / 1e9, "1e9",
              "published", kPublishedParameters / 1e9, parameters / kPublishedParameters});
  report.Add({"sparse", "DeepSeek-MoE-16B node share: window W",
              static_cast<double>(schedule->window()), "steps", "least: full state / budget",
              least_window, schedule->window() / least_window});
  report.Add({"sparse", node + "costliest slot", costliest / 1e9, "GB",
              "dense full state per step", dense / 1e9, static_cast<double>(costliest) / dense});
  report.Add({"sparse", node + "mean slot", mean / 1e9, "GB", "dense full state per step",
              dense / 1e9, mean / dense});
  const double sparse_seconds = costliest / copy_bytes_per_second;
  const double dense_seconds = dense / copy_bytes_per_second;
  report.Add({"sparse", node + "costliest slot at memcpy", sparse_seconds, "s",
              "iteration time (the budget)", kIterationSeconds,
              sparse_seconds / kIterationSeconds});
  report.Add({"sparse", "DeepSeek-MoE-16B: dense state at memcpy", dense_seconds, "s",
              "iteration time (the budget)", kIterationSeconds,
              dense_seconds / kIterationSeconds});
  report.AddNote(
      "sparse",
      absl::StrFormat(
          "DeepSeek-MoE-16B rows: a schedule, not a training run. moesnap::SparseSchedule of node "
          "0's share of an %d-node job (%d routed experts of each of layers 1-27, 1/%d of every "
          "other tensor: %zu operators, %.1f GB of full state) from the published config (layer 0 "
          "dense, 27 MoE layers of 64 routed + 2 shared experts); full state %.0f bytes per "
          "parameter (fp32 master + two Adam moments), weights %.0f (bf16), %.0f MiB of RNG and "
          "data state every step. Iteration %.1f s assumed (64 A100s at 40%% of 312 TFLOP/s, "
          "0.7M tokens per step); memcpy measured here %.2f GB/s (one thread, %zu MiB), so the "
          "per-step budget is %.2f GB. The window can exceed the least one: every slot also "
          "copies the weights of the operators still to be captured. No routing statistics: "
          "experts keep their list order.",
          kNodes, kRoutedExperts / kNodes, kNodes, table.operators.size(), dense / 1e9,
          kFullStateBytesPerParameter, kWeightBytesPerParameter, kEveryStepBytes / 1048576.0,
          kIterationSeconds, copy_bytes_per_second / 1e9, kCopyBytes >> 20, budget / 1e9));
  return absl::OkStatus();
}

}  // namespace

absl::Status RunSparseSuite(Report& report) {
  if (absl::Status status = AddScheduleRows(report); !status.ok()) return status;
  absl::Status status = RunPythonScript(
      {.suite = "sparse", .file = "sparse.py", .pool_bytes = uint64_t{1} << 30}, report);
  if (absl::IsUnavailable(status)) {
    return absl::UnavailableError(absl::StrCat("example MoE rows not run: ", status.message()));
  }
  return status;
}

}  // namespace moesnap::bench
