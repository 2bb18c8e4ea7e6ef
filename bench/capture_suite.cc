// The capture suite: a real daemon (in this process, over its real Unix socket) snapshots 1 GiB of
// trainer host memory, compared with memcpy of the same bytes by the same number of threads; the
// trainer's blocking time inside Snapshot, which the consistency rule needs to be tiny; and the same
// for a rank of 16,000 small tensors, where the daemon's cost per region and step shows.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/aligned_buffer.h"
#include "bench/suites.h"
#include "common/shared_memory.h"
#include "daemon/daemon.h"
#include "erasure/crc32c.h"
#include "moesnap/client.h"

namespace moesnap::bench {
namespace {

constexpr int kRegions = 64;
constexpr size_t kRegionBytes = 16 << 20;  // 64 x 16 MiB = 1 GiB
constexpr size_t kStateBytes = kRegions * kRegionBytes;
constexpr int kThreads = 2;
constexpr size_t kChunkBytes = 4 << 20;  // the daemon's default chunk
constexpr int kMeasuredSteps = 50;
// Adam state of 4,000 small layers: weight, bias, two moments each.
constexpr int kManyRegions = 16000;
constexpr size_t kManyRegionBytes = 4096;
constexpr size_t kManyStateBytes = kManyRegions * kManyRegionBytes;  // 62.5 MiB
constexpr int kManyMeasuredSteps = 100;
// Timed whole-rank restores, and rounds of the memcpy beside them: as many, so that the best of
// each is taken from as many tries.
constexpr int kRestores = 20;

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration duration) { return std::chrono::duration<double>(duration).count(); }

// memcpy of `bytes` split over `threads` threads, as the daemon splits a capture into chunks.
void ParallelCopy(uint8_t* destination, const uint8_t* source, size_t bytes, int threads) {
  std::vector<std::thread> workers;
  const size_t share = bytes / threads;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([=] {
      std::memcpy(destination + t * share, source + t * share, t + 1 == threads ? bytes - t * share : share);
    });
  }
  for (std::thread& worker : workers) worker.join();
}

// The best of five runs of `work` over every 4 MiB chunk of the 1 GiB state, the chunks dealt to
// kThreads threads in turn as the capture threads take them, in seconds.
template <typename Work>
double BestChunkedSeconds(Work work) {
  double best = 1e9;
  for (int round = 0; round < 5; ++round) {
    const Clock::time_point start = Clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < kThreads; ++t) {
      workers.emplace_back([&, t] {
        for (size_t chunk = t; chunk < kStateBytes / kChunkBytes; chunk += kThreads) {
          work(chunk * kChunkBytes);
        }
      });
    }
    for (std::thread& worker : workers) worker.join();
    best = std::min(best, Seconds(Clock::now() - start));
  }
  return best;
}

// User and system CPU time of this process so far (every thread's).
double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& time) { return time.tv_sec + time.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

double Percentile(std::vector<double> values, double fraction) {
  std::sort(values.begin(), values.end());
  return values[std::min(values.size() - 1, static_cast<size_t>(fraction * values.size()))];
}


// Each measured step's time inside Snapshot() and to WaitCaptured's return, in ms, after two
// warm-up steps that fault in both halves of the pool; and the round trip of a call that asks the
// daemon next to nothing (WaitCommitted of the step before, committed already), made right after
// Snapshot() returns, while the step captures: what any call costs then.
struct StepTimes {
  std::vector<double> blocking_ms;
  std::vector<double> capture_ms;
  std::vector<double> round_trip_ms;
};
absl::StatusOr<StepTimes> MeasureSteps(Client& client, int measured_steps) {
  StepTimes times;
  for (int step = 1; step <= measured_steps + 2; ++step) {
    const Clock::time_point start = Clock::now();
    absl::StatusOr<uint64_t> bytes = client.Snapshot(step);
    const Clock::time_point returned = Clock::now();
    if (!bytes.ok()) return bytes.status();
    if (step > 1) {
      if (absl::Status before = client.WaitCommitted(step - 1); !before.ok()) return before;
    }
    const Clock::time_point answered = Clock::now();
    if (absl::Status wait = client.WaitCaptured(step); !wait.ok()) return wait;
    if (step <= 2) continue;
    times.blocking_ms.push_back(Seconds(returned - start) * 1e3);
    times.round_trip_ms.push_back(Seconds(answered - returned) * 1e3);
    times.capture_ms.push_back(Seconds(Clock::now() - start) * 1e3);
  }
  return times;
}

// kRestores whole-rank restores, each in seconds.
absl::StatusOr<std::vector<double>> RestoreSeconds(Client& client) {
  std::vector<double> seconds;
  for (int round = 0; round < kRestores; ++round) {
    const Clock::time_point start = Clock::now();
    absl::StatusOr<RestoreResult> restored = client.Restore();
    if (!restored.ok()) return restored.status();
    seconds.push_back(Seconds(Clock::now() - start));
  }
  return seconds;
}

// The best of kRestores rounds of memcpy of `bytes` split over kThreads threads, in seconds.
double BestCopySeconds(uint8_t* destination, const uint8_t* source, size_t bytes) {
  double best = 1e9;
  for (int round = 0; round < kRestores; ++round) {
    const Clock::time_point start = Clock::now();
    ParallelCopy(destination, source, bytes, kThreads);
    best = std::min(best, Seconds(Clock::now() - start));
  }
  return best;
}

// Rank 1 of the suite's daemon registers 16,000 regions of 4 KiB and snapshots them step after
// step: Snapshot()'s blocking time and the step's capture time, and a local restore beside memcpy
// of the same bytes.
absl::Status RunManyTensorsCase(const std::string& agent_socket, Report& report) {
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.socket_path = agent_socket, .rank = 1});
  if (!client.ok()) return client.status();
  absl::StatusOr<std::shared_ptr<SharedBuffer>> state = (*client)->AllocateHost(kManyStateBytes);
  if (!state.ok()) return state.status();
  std::memset((*state)->data(), 0x5a, kManyStateBytes);
  // Registered as a trainer does: the memory handed over once, every region in one call.
  const Clock::time_point registration = Clock::now();
  absl::StatusOr<std::vector<MemoryHandle>> memory = (*client)->ShareMemory({(*state)->fd()});
  if (!memory.ok()) return memory.status();
  std::vector<HostRegion> regions;
  for (int region = 0; region < kManyRegions; ++region) {
    regions.push_back({{absl::StrCat("layer", region / 4, ".", region % 4), "float32", {1024}},
                       memory->front(), region * kManyRegionBytes, kManyRegionBytes});
  }
  if (absl::Status registered = (*client)->RegisterHostRegions(regions); !registered.ok()) {
    return registered;
  }
  const double registration_s = Seconds(Clock::now() - registration);

  const double cpu_before = ProcessCpuSeconds();
  absl::StatusOr<StepTimes> times = MeasureSteps(**client, kManyMeasuredSteps);
  if (!times.ok()) return times.status();
  // What a step costs the node's cores, whether or not they were busy with other work meanwhile:
  // the process's CPU time (the daemon's threads and the trainer's calls) over every step.
  const double cpu_per_step_ms =
      (ProcessCpuSeconds() - cpu_before) * 1e3 / (kManyMeasuredSteps + 2);
  absl::StatusOr<std::vector<double>> restores = RestoreSeconds(**client);
  if (!restores.ok()) return restores.status();
  const double best_restore = *std::min_element(restores->begin(), restores->end());
  AlignedBuffer copy(kManyStateBytes, 1);
  const double best_copy = BestCopySeconds((*state)->data(), copy.data(), kManyStateBytes);

  const double median_blocking = Percentile(times->blocking_ms, 0.5);
  const double median_capture = Percentile(times->capture_ms, 0.5);
  report.Add({"capture", "16,000 tensors: Snapshot() blocking, median", median_blocking, "ms",
              "goal", 1.0, 1.0 / median_blocking});
  const double median_round_trip = Percentile(times->round_trip_ms, 0.5);
  report.Add({"capture", "16,000 tensors: Snapshot() blocking, median", median_blocking, "ms",
              "an empty call while the step captures, median", median_round_trip,
              median_round_trip / median_blocking});
  report.Add({"capture", "16,000 tensors: capture of a step, median", median_capture, "ms",
              "memcpy of the bytes, 2 threads", best_copy * 1e3, best_copy * 1e3 / median_capture});
  report.Add({"capture", "16,000 tensors: CPU time of a step (daemon and trainer)",
              cpu_per_step_ms, "ms", "CPU time of memcpy of the bytes, 2 threads",
              best_copy * kThreads * 1e3, best_copy * kThreads * 1e3 / cpu_per_step_ms});
  report.Add({"capture", "16,000 tensors: local restore (+CRC check)", best_restore * 1e3, "ms",
              "memcpy of the bytes, 2 threads", best_copy * 1e3, best_copy / best_restore});
  report.AddNote("capture", absl::StrCat(
      "16,000 tensors: a second rank registers ", kManyRegions, " regions of 4 KiB (", 
      kManyStateBytes >> 20, " MiB; the Adam state of 4,000 small layers) in ", registration_s,
      " s and snapshots them ", kManyMeasuredSteps, " times after two warm-up steps; medians. "
      "The goal for Snapshot()'s blocking time is 1 ms whatever the number of tensors."));
  return absl::OkStatus();
}

}  // namespace

absl::Status RunCaptureSuite(Report& report) {
  const std::string directory = absl::StrCat("/tmp/moesnap-bench-", getpid());
  std::filesystem::create_directories(directory);
  daemon::DaemonOptions options;
  options.agent_socket = directory + "/agent.sock";
  options.admin_socket = directory + "/admin.sock";
  options.http.address = "";  // a benchmark serves no metrics
  options.pool.name = absl::StrCat("moesnap-bench-", getpid());
  options.pool.bytes = 2 * (kStateBytes + kManyStateBytes) + (64 << 20);  // committed + in flight
  options.pool.lock = daemon::PoolLockMode::kOff;
  options.capture.threads = kThreads;
  absl::Status status;
  {
    absl::StatusOr<std::unique_ptr<daemon::Daemon>> daemon = daemon::Daemon::Start(options);
    if (!daemon.ok()) return daemon.status();
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.socket_path = options.agent_socket, .rank = 0});
    if (!client.ok()) return client.status();
    absl::StatusOr<std::shared_ptr<SharedBuffer>> state = (*client)->AllocateHost(kStateBytes);
    if (!state.ok()) return state.status();
    std::memset((*state)->data(), 0x3c, kStateBytes);
    for (int region = 0; region < kRegions; ++region) {
      status.Update((*client)->RegisterHostRegion({absl::StrCat("expert", region), "float32", {}},
                                                  *state, region * kRegionBytes, kRegionBytes));
    }
    if (!status.ok()) return status;

    absl::StatusOr<StepTimes> times = MeasureSteps(**client, kMeasuredSteps);
    if (!times.ok()) return times.status();
    const std::vector<double>& blocking_ms = times->blocking_ms;
    const double best_capture = *std::min_element(times->capture_ms.begin(), times->capture_ms.end()) / 1e3;

    AlignedBuffer destination(kStateBytes, 1);
    const double best_copy = BestCopySeconds(destination.data(), (*state)->data(), kStateBytes);

    // What a capture must do at the least: move the bytes and checksum them, in two passes per
    // 4 MiB chunk (memcpy, then ISA-L over the copy) and in one (CopyWithCrc32c); and the CRC's
    // own speed over the same bytes, read from memory.
    std::vector<uint32_t> crcs(kStateBytes / kChunkBytes);
    const uint8_t* trainer_bytes = (*state)->data();
    const double best_copy_then_crc = BestChunkedSeconds([&](size_t offset) {
      std::memcpy(destination.data() + offset, trainer_bytes + offset, kChunkBytes);
      crcs[offset / kChunkBytes] = erasure::Crc32c(destination.data() + offset, kChunkBytes);
    });
    const double best_fused = BestChunkedSeconds([&](size_t offset) {
      crcs[offset / kChunkBytes] =
          erasure::CopyWithCrc32c(destination.data() + offset, trainer_bytes + offset,
                                  kChunkBytes, 0);
    });
    const double best_crc = BestChunkedSeconds([&](size_t offset) {
      crcs[offset / kChunkBytes] = erasure::Crc32c(trainer_bytes + offset, kChunkBytes);
    });

    absl::StatusOr<std::vector<double>> restores = RestoreSeconds(**client);
    if (!restores.ok()) return restores.status();
    const double best_restore = *std::min_element(restores->begin(), restores->end());
    const double median_restore = Percentile(*restores, 0.5);
    const double best_copy_back = BestCopySeconds((*state)->data(), destination.data(), kStateBytes);

    const double gigabytes = kStateBytes / 1e9;
    report.Add({"capture", "host capture 1 GiB, 2 threads (+CRC-32C)", gigabytes / best_capture,
                "GB/s", "memcpy 1 GiB, 2 threads", gigabytes / best_copy, best_copy / best_capture});
    report.Add({"capture", "host capture 1 GiB, 2 threads (+CRC-32C)", gigabytes / best_capture,
                "GB/s", "memcpy then CRC-32C per 4 MiB, 2 threads", gigabytes / best_copy_then_crc,
                best_copy_then_crc / best_capture});
    // The best step is the figure the ETTR model takes; the median says how steady it is on a
    // machine other work shares.
    const double median_capture = Percentile(times->capture_ms, 0.5) / 1e3;
    report.Add({"capture", "host capture 1 GiB, 2 threads (+CRC-32C), median step",
                gigabytes / median_capture, "GB/s", "memcpy 1 GiB, 2 threads",
                gigabytes / best_copy, best_copy / median_capture});
    report.Add({"capture", "copy+CRC-32C in one pass per 4 MiB, 2 threads", gigabytes / best_fused,
                "GB/s", "memcpy 1 GiB, 2 threads", gigabytes / best_copy, best_copy / best_fused});
    report.Add({"capture", "CRC-32C alone (ISA-L) per 4 MiB, 2 threads", gigabytes / best_crc,
                "GB/s", "memcpy 1 GiB, 2 threads", gigabytes / best_copy, best_copy / best_crc});
    const double median = Percentile(blocking_ms, 0.5), p99 = Percentile(blocking_ms, 0.99);
    report.Add({"capture", "Snapshot() blocking, median", median, "ms", "capture time of the step",
                best_capture * 1e3, median / (best_capture * 1e3)});
    report.Add({"capture", "Snapshot() blocking, p99", p99, "ms", "capture time of the step",
                best_capture * 1e3, p99 / (best_capture * 1e3)});
    const double round_trip = Percentile(times->round_trip_ms, 0.5);
    report.Add({"capture", "Snapshot() blocking, median", median, "ms",
                "an empty call while the step captures, median", round_trip, round_trip / median});
    report.Add({"capture", "local restore 1 GiB, 2 threads (+CRC check)", gigabytes / best_restore,
                "GB/s", "memcpy 1 GiB, 2 threads", gigabytes / best_copy_back,
                best_copy_back / best_restore});
    report.Add({"capture", "local restore 1 GiB, 2 threads (+CRC check), median",
                gigabytes / median_restore, "GB/s", "memcpy 1 GiB, 2 threads",
                gigabytes / best_copy_back, best_copy_back / median_restore});
    report.AddNote("capture", absl::StrCat(
        "A real moesnapd in the benchmark's process, over its Unix socket; 64 regions of 16 MiB in "
        "trainer shared memory, ", kMeasuredSteps, " measured steps after two warm-up steps, best "
        "step reported (and the median step), then ", kRestores, " timed restores (the best and "
        "the median reported) and as many rounds of each memcpy. Capture and restore run on the "
        "daemon's capture threads and compute or check the CRC-32C of every 4 MiB chunk in the "
        "same pass as the copy (",
        erasure::OnePassKernel() == erasure::CopyCrcKernel::kInterleavedWide
            ? "the crc32 instruction, three interleaved streams, 64-byte loads and stores"
        : erasure::CopyCrcKernelAvailable(erasure::CopyCrcKernel::kInterleaved)
            ? "the crc32 instruction, three interleaved streams"
            : "no SSE4.2: memcpy and ISA-L per 64 KiB block",
        ")."));
    status = RunManyTensorsCase(options.agent_socket, report);
  }
  std::filesystem::remove_all(directory);
  for (const char* suffix : {".data", ".journal"}) {
    SharedMemory::Unlink(options.pool.name + suffix).IgnoreError();
  }
  return status;
}

}  // namespace moesnap::bench
