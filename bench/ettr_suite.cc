// The ETTR suite: effective training time ratio (useful time over wall time) of the job
// bench/modelled_job.h describes, modelled from costs measured in this run and from stated
// assumptions, beside the figures other systems published. A model, not a measurement: every input
// is printed in the note.
//
//   ETTR = T / (T + stall) x max(0, 1 - failure cost / MTBF)
//   stall        = Snapshot() blocking + max(0, per-step copy time - T)   (the copy overlaps a step)
//   failure cost = rebuild of the lost node + local restore + lost work
//   lost work    = half a step (dense per-step snapshots), or 1.5 W steps of replay (sparse, MoEtion)
//   sparse copy  = the costliest slot of the job's sparse schedule (window W) at the capture rate
//
// Each figure is given twice: with the rebuild as measured here (loopback, every node on the same
// cores), and with the network at the modelled job's line rate, so that the loopback machine does
// not decide the headline. On loopback every byte the rebuild moves (to the helpers and from them)
// crosses the one link; on a network each node has its own, and the rebuilding node's carries only
// what it receives (helpers decode, so about one byte per byte rebuilt). The rebuild at the line
// rate keeps the share of raw TCP it achieved on loopback for all the bytes it moved, on that link.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/aligned_buffer.h"
#include "bench/modelled_job.h"
#include "bench/raw_tcp.h"
#include "bench/suites.h"
#include "bench/timing.h"
#include "moesnap/sparse_schedule.h"

namespace moesnap::bench {
namespace {

using modelled_job::kIterationSeconds;

constexpr size_t kLimitBytes = size_t{256} << 20;
constexpr size_t kTcpChunkBytes = size_t{4} << 20;

// The figure a suite measured earlier in this run, else `assumed`, named in `not_measured`.
double Input(const Report& report, const std::string& suite, const std::string& prefix,
             double assumed, const std::string& what, std::vector<std::string>& not_measured) {
  for (const Record& record : report.records()) {
    if (record.suite == suite && record.name.rfind(prefix, 0) == 0) return record.value;
  }
  not_measured.push_back(what);
  return assumed;
}

}  // namespace

absl::Status RunEttrSuite(Report& report) {
  // Inputs measured in this run: the capture, cluster and sparse suites' figures when they ran
  // before, else memcpy here (an upper bound for capture and restore) and a conservative rebuild
  // rate. Raw TCP on loopback is measured here: the rebuild's share of it carries to the line rate.
  AlignedBuffer source(kLimitBytes, 0x11), destination(kLimitBytes, 0);
  RawTcpStream raw(kTcpChunkBytes);
  const Comparison limits = CompareGigabytesPerSecond(
      [&] { std::memcpy(destination.data(), source.data(), kLimitBytes); },
      [&] { raw.Send(source.data(), static_cast<int>(kLimitBytes / kTcpChunkBytes)); }, kLimitBytes,
      {.min_seconds_per_repetition = 0.1, .repetitions = 2});
  std::vector<std::string> not_measured;
  const double capture_gbps = Input(report, "capture", "host capture", limits.value,
                                    "capture (memcpy here instead)", not_measured);
  const double restore_gbps = Input(report, "capture", "local restore", limits.value,
                                    "restore (memcpy here instead)", not_measured);
  const double blocking_ms = Input(report, "capture", "Snapshot() blocking, median", 1.0,
                                   "Snapshot() blocking (1 ms assumed)", not_measured);
  const double rebuild_gbps = Input(report, "cluster", "rebuild of a node", 0.25,
                                    "rebuild (0.25 GB/s assumed)", not_measured);
  const double moved_per_byte =
      Input(report, "cluster", "rebuild: bytes moved in all per byte rebuilt", 4.0,
            "bytes a rebuild moves (k = 4 per byte assumed)", not_measured);
  const double received_per_byte =
      Input(report, "cluster", "rebuild: bytes the rebuilding node receives per byte", 4.0,
            "bytes the rebuilding node receives (k = 4 per byte assumed)", not_measured);
  const double line_gbps = modelled_job::kLineRateBitsPerSecond / 8 / 1e9;
  const double share_of_raw_tcp = rebuild_gbps * moved_per_byte / limits.baseline;
  const double rebuild_at_line_gbps = share_of_raw_tcp * line_gbps / received_per_byte;

  const double node_bytes = modelled_job::NodeStateBytes();
  const double copy_seconds = node_bytes / (capture_gbps * 1e9);
  const double dense_stall = blocking_ms / 1e3 + std::max(0.0, copy_seconds - kIterationSeconds);
  // The sparse schedule of the job at this capture rate: its window, and its costliest slot.
  absl::StatusOr<SparseSchedule> schedule = SparseSchedule::Build(
      modelled_job::NodeShareOfTheJob().operators,
      {.iteration_seconds = kIterationSeconds,
       .copy_bytes_per_second = capture_gbps * 1e9,
       .every_step_bytes = modelled_job::kEveryStepBytes});
  if (!schedule.ok()) return schedule.status();
  const double window = schedule->window();
  uint64_t costliest_slot = 0;
  for (const Slot& slot : schedule->slots()) costliest_slot = std::max(costliest_slot, slot.bytes);
  const double sparse_copy = costliest_slot / (capture_gbps * 1e9);
  const double sparse_stall = blocking_ms / 1e3 + std::max(0.0, sparse_copy - kIterationSeconds);
  const double restore_seconds = node_bytes / (restore_gbps * 1e9);
  auto ettr = [&](double stall, double lost_work, double rebuild, double mtbf) {
    const double recovery = node_bytes / (rebuild * 1e9) + restore_seconds;
    return kIterationSeconds / (kIterationSeconds + stall) *
           std::max(0.0, 1.0 - (recovery + lost_work) / mtbf);
  };
  struct Network {
    std::string name;
    double rebuild_gbps;
  };
  const Network networks[] = {
      {"rebuild as measured", rebuild_gbps},
      {absl::StrFormat("at %.0f Gb/s", modelled_job::kLineRateBitsPerSecond / 1e9),
       rebuild_at_line_gbps}};
  for (const Network& network : networks) {
    for (double minutes : {120.0, 30.0, 10.0}) {
      const double mtbf = minutes * 60;
      const double dense = ettr(dense_stall, 0.5 * kIterationSeconds, network.rebuild_gbps, mtbf);
      const double sparse =
          ettr(sparse_stall, 1.5 * window * kIterationSeconds, network.rebuild_gbps, mtbf);
      const std::string when = absl::StrCat("MTBF ", minutes, " min, ", network.name);
      const std::string sparse_name = absl::StrFormat("sparse window W=%.0f, %s", window, when);
      if (minutes == 10.0) {
        // Published at a 10-minute MTBF (MoEtion/MoEvement, NSDI'26, on their testbed).
        report.Add({"ettr", absl::StrCat("dense per-step snapshots, ", when), dense, "ETTR",
                    "MoEtion (published)", 0.95, dense / 0.95});
        report.Add({"ettr", absl::StrCat("dense per-step snapshots, ", when), dense, "ETTR",
                    "CheckFreq (published by MoEtion)", 0.67, dense / 0.67});
        report.Add({"ettr", sparse_name, sparse, "ETTR", "Gemini, best (published by MoEtion)",
                    0.76, sparse / 0.76});
      } else {
        report.Add({"ettr", absl::StrCat("dense per-step snapshots, ", when), dense, "ETTR",
                    "no failures, no stall", 1.0, dense});
        report.Add({"ettr", sparse_name, sparse, "ETTR", "no failures, no stall", 1.0, sparse});
      }
    }
  }
  report.AddNote(
      "ettr",
      absl::StrFormat(
          "A model of the job in bench/modelled_job.h: DeepSeek-MoE-16B, %.1fe9 parameters x %.0f "
          "bytes of state over %d nodes = %.1f GB per node, %.1f s per iteration, one node lost per "
          "failure. Measured in this run: capture %.1f GB/s, restore %.1f GB/s, Snapshot() "
          "blocking %.2f ms, rebuild %.2f GB/s beside raw TCP %.2f GB/s on loopback (2 cores shared "
          "by every node), moving %.1f bytes per byte rebuilt: %.2f of raw TCP. At %.0f Gb/s per "
          "node the rebuilding node's link carries %.2f bytes per byte rebuilt at that share: %.2f "
          "GB/s. Per-step "
          "dense copy %.1f s (stall %.2f s); the job's sparse schedule at this capture rate has "
          "W=%.0f, its costliest slot %.1f GB (stall %.3f s), and replays 1.5 W steps after a "
          "failure; restore %.1f s; the rebuild takes %.0f s as "
          "measured, %.1f s at the line rate. Published figures are MoEtion's own, on 96 A100s.%s",
          modelled_job::kPublishedParameters / 1e9, modelled_job::kFullStateBytesPerParameter,
          modelled_job::kNodes, node_bytes / 1e9, kIterationSeconds, capture_gbps, restore_gbps,
          blocking_ms, rebuild_gbps, limits.baseline, moved_per_byte, share_of_raw_tcp,
          modelled_job::kLineRateBitsPerSecond / 1e9, received_per_byte, rebuild_at_line_gbps,
          copy_seconds, dense_stall, window, costliest_slot / 1e9, sparse_stall,
          restore_seconds,
          node_bytes / (rebuild_gbps * 1e9), node_bytes / (rebuild_at_line_gbps * 1e9),
          not_measured.empty()
              ? ""
              : absl::StrCat(" Not measured in this run (their suites did not run before it): ",
                             absl::StrJoin(not_measured, ", "), ".")));
  return absl::OkStatus();
}

}  // namespace moesnap::bench
