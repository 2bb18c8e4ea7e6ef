// The gpu suite: a real moesnapd process captures 1 GiB of this process's device memory, shared by
// CUDA IPC, into its pinned pool, and restores it; beside cudaMemcpy of the same bytes between the
// device and pinned memory in this process, in the same run. The daemon runs as its own process,
// as in production: a CUDA IPC handle cannot be opened by the process that made it. UNAVAILABLE,
// with the reason, where no GPU is usable.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/suites.h"
#include "erasure/crc32c.h"
#include "moesnap/client.h"
#include "tests/testing/test_daemon.h"

namespace moesnap::bench {
namespace {

constexpr size_t kBytes = size_t{1} << 30;
constexpr int kRegions = 16;
constexpr int kRounds = 10;
constexpr uint8_t kPattern = 0x5a;
constexpr int kCaptureThreads = 2;      // the daemon's default [capture] threads
constexpr int kManyCaptureThreads = 6;  // what a node with cores to spare can give
// Adam state of 4,000 small layers on the GPU: weight, bias, two moments each.
constexpr int kManyRegions = 16000;
constexpr size_t kManyRegionBytes = 4096;
constexpr size_t kManyBytes = kManyRegions * kManyRegionBytes;  // 62.5 MiB
constexpr int kManyMeasuredSteps = 20;
constexpr size_t kChunkBytes = 4 << 20;  // the daemon's default chunk
using Clock = std::chrono::steady_clock;

absl::Status CudaCheck(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

double Seconds(Clock::time_point start, Clock::time_point end) {
  return std::chrono::duration<double>(end - start).count();
}

// Times `copy` kRounds times; the best round's seconds.
template <typename Copy>
absl::StatusOr<double> BestOf(Copy copy) {
  double best = 1e9;
  for (int round = 0; round < kRounds; ++round) {
    const Clock::time_point start = Clock::now();
    if (absl::Status status = copy(); !status.ok()) return status;
    best = std::min(best, Seconds(start, Clock::now()));
  }
  return best;
}

// The best cudaMemcpy of a buffer's bytes each way, in seconds: the copy engine's limit.
struct CopyTimes {
  double download = 0;  // device to pinned host
  double upload = 0;    // pinned host to device
};

// Device memory and a pinned host buffer of `bytes` each, the device memory set to kPattern.
struct Buffers {
  void* device = nullptr;
  void* pinned = nullptr;
  size_t bytes = 0;
  ~Buffers() {
    if (pinned != nullptr) cudaFreeHost(pinned);
    if (device != nullptr) cudaFree(device);
  }
  absl::Status Allocate(size_t size) {
    bytes = size;
    if (absl::Status s = CudaCheck(cudaMalloc(&device, bytes), "cudaMalloc"); !s.ok()) return s;
    if (absl::Status s = CudaCheck(cudaMallocHost(&pinned, bytes), "cudaMallocHost"); !s.ok()) {
      return s;
    }
    return Fill();
  }
  // Sets every byte of the device memory to kPattern.
  absl::Status Fill() { return CudaCheck(cudaMemset(device, kPattern, bytes), "cudaMemset"); }
  // Clears the device memory, for a restore to fill.
  absl::Status Clear() {
    if (absl::Status s = CudaCheck(cudaMemset(device, 0, bytes), "cudaMemset"); !s.ok()) return s;
    return CudaCheck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  // Whether the device memory holds kPattern in every byte (read back through the pinned buffer).
  absl::Status CheckRestored() {
    if (absl::Status s = CudaCheck(cudaMemcpy(pinned, device, bytes, cudaMemcpyDeviceToHost),
                                   "cudaMemcpy");
        !s.ok()) {
      return s;
    }
    const uint8_t* back = static_cast<const uint8_t*>(pinned);
    if (back[0] != kPattern || std::memcmp(back, back + 1, bytes - 1) != 0) {
      return absl::DataLossError("the restored device memory differs from what was captured");
    }
    return absl::OkStatus();
  }
  absl::StatusOr<CopyTimes> TimeCopies() {
    absl::StatusOr<double> download = BestOf([&] {
      return CudaCheck(cudaMemcpy(pinned, device, bytes, cudaMemcpyDeviceToHost),
                       "cudaMemcpy device to host");
    });
    if (!download.ok()) return download.status();
    absl::StatusOr<double> upload = BestOf([&] {
      return CudaCheck(cudaMemcpy(device, pinned, bytes, cudaMemcpyHostToDevice),
                       "cudaMemcpy host to device");
    });
    if (!upload.ok()) return upload.status();
    return CopyTimes{*download, *upload};
  }
};

// The CPU's part of a capture or restore: CRC-32C of every 4 MiB chunk of `data`, the chunks dealt
// to `threads` threads in turn as the capture threads take them.
absl::Status CrcOfChunks(const uint8_t* data, int threads) {
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([=] {
      uint32_t sink = 0;
      for (size_t chunk = t; chunk < kBytes / kChunkBytes; chunk += threads) {
        sink ^= erasure::Crc32cExtend(0, data + chunk * kChunkBytes, kChunkBytes);
      }
      volatile uint32_t kept = sink;
      (void)kept;
    });
  }
  for (std::thread& worker : workers) worker.join();
  return absl::OkStatus();
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// A second rank of the daemon holding 16,000 GPU tensors of 4 KiB in one cudaMalloc block, written
// on one stream: what a step costs per region, beside cudaMemcpy of the same bytes.
absl::Status MeasureManyTensors(const testing::TestDaemon& daemon, Report& report) {
  Buffers buffers;  // freed after the client has ended its session
  if (absl::Status s = buffers.Allocate(kManyBytes); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.socket_path = daemon.agent_socket(), .rank = 1});
  if (!client.ok()) return client.status();
  std::vector<DeviceRegion> regions;
  regions.reserve(kManyRegions);
  for (int i = 0; i < kManyRegions; ++i) {
    regions.push_back({{absl::StrCat("layer", i / 4, ".state", i % 4), "float32", {1024}},
                       {0, static_cast<uint8_t*>(buffers.device) + i * kManyRegionBytes,
                        kManyRegionBytes, nullptr}});
  }
  const Clock::time_point registering = Clock::now();
  if (absl::Status s = (*client)->RegisterDeviceRegions(regions); !s.ok()) return s;
  const double registration = Seconds(registering, Clock::now());

  std::vector<double> blocking_ms, capture_ms;
  for (int step = 1; step <= kManyMeasuredSteps + 2; ++step) {
    const Clock::time_point start = Clock::now();
    absl::StatusOr<uint64_t> bytes = (*client)->Snapshot(step);
    const Clock::time_point returned = Clock::now();
    if (!bytes.ok()) return bytes.status();
    if (absl::Status s = (*client)->WaitCaptured(step); !s.ok()) return s;
    if (step <= 2) continue;  // the first opens the IPC handles
    blocking_ms.push_back(Seconds(start, returned) * 1e3);
    capture_ms.push_back(Seconds(start, Clock::now()) * 1e3);
  }
  if (absl::Status s = (*client)->WaitCommitted(kManyMeasuredSteps + 2); !s.ok()) return s;
  std::vector<double> restore_ms;
  for (int round = 0; round < 5; ++round) {
    if (absl::Status s = buffers.Clear(); !s.ok()) return s;
    const Clock::time_point start = Clock::now();
    absl::StatusOr<RestoreResult> restored = (*client)->Restore();
    if (!restored.ok()) return restored.status();
    restore_ms.push_back(Seconds(start, Clock::now()) * 1e3);
  }
  if (absl::Status s = buffers.CheckRestored(); !s.ok()) return s;
  absl::StatusOr<CopyTimes> copies = buffers.TimeCopies();
  if (!copies.ok()) return copies.status();

  const double blocking = Median(blocking_ms), capture = Median(capture_ms);
  const double restore = Median(restore_ms);
  report.Add({"gpu", "16,000 GPU tensors: Snapshot() blocking, median", blocking, "ms", "goal", 1.0,
              1.0 / blocking});
  report.Add({"gpu", "16,000 GPU tensors: capture of a step, median", capture, "ms",
              "cudaMemcpy D2H of the bytes, pinned", copies->download * 1e3,
              copies->download * 1e3 / capture});
  report.Add({"gpu", "16,000 GPU tensors: restore (+CRC check), median", restore, "ms",
              "cudaMemcpy H2D of the bytes, pinned", copies->upload * 1e3,
              copies->upload * 1e3 / restore});
  report.AddNote("gpu", absl::StrCat(
                            "16,000 GPU tensors: 4 KiB regions (62.5 MiB, the Adam state of 4,000 "
                            "small layers) packed in one cudaMalloc block and written on one "
                            "stream, registered by a second rank in one call (",
                            absl::StrFormat("%.0f", registration * 1e3), " ms); medians of ",
                            kManyMeasuredSteps, " steps after two warm-up steps, and of 5 "
                            "restores."));
  return absl::OkStatus();
}


// One daemon with `threads` capture threads capturing and restoring 1 GiB of `buffers` as rank 0,
// beside the copy engine's speed and the threads' CRC-32C of the same bytes; then, with the
// suite's first daemon, the 16,000-tensor rank.
absl::Status MeasureOneGiB(int threads, Buffers& buffers, const CopyTimes& copies,
                           Report& report) {
  // The pool holds the committed step and the one being captured of both ranks; pinned as in
  // production. The journal holds the 16,000-region rank's records.
  testing::TestDaemon daemon({.pool_bytes = absl::StrCat(((2 * kBytes + 2 * kManyBytes) >> 20) + 64,
                                                         "MiB"),
                              .journal_bytes = "8MiB",
                              .pool_lock = "required",
                              .capture_threads = threads});
  if (!daemon.Start()) return absl::InternalError("moesnapd did not start");
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.socket_path = daemon.agent_socket(), .rank = 0});
  if (!client.ok()) return client.status();
  if (absl::Status s = buffers.Fill(); !s.ok()) return s;
  std::vector<DeviceRegion> regions;
  for (int region = 0; region < kRegions; ++region) {
    regions.push_back({{absl::StrCat("expert", region), "bfloat16", {}},
                       {0, static_cast<uint8_t*>(buffers.device) + region * (kBytes / kRegions),
                        kBytes / kRegions, nullptr}});
  }
  if (absl::Status s = (*client)->RegisterDeviceRegions(regions); !s.ok()) return s;

  // Capture: Snapshot returns once the step is reserved and the IPC events recorded; the copy runs
  // on the daemon's capture threads until WaitCaptured. The first step opens the IPC handles.
  double best_capture = 1e9;
  std::vector<double> blocking;
  for (int round = 0; round <= kRounds; ++round) {
    const Clock::time_point start = Clock::now();
    absl::StatusOr<uint64_t> bytes = (*client)->Snapshot(round + 1);
    const Clock::time_point returned = Clock::now();
    if (!bytes.ok()) return bytes.status();
    if (absl::Status s = (*client)->WaitCaptured(round + 1); !s.ok()) return s;
    if (round > 0) {
      best_capture = std::min(best_capture, Seconds(start, Clock::now()));
      blocking.push_back(Seconds(start, returned) * 1e3);
    }
  }
  if (absl::Status s = (*client)->WaitCommitted(kRounds + 1); !s.ok()) return s;

  // Restore: the committed step back into device memory that was cleared first, checked whole.
  double best_restore = 1e9;
  for (int round = 0; round < kRounds; ++round) {
    if (absl::Status s = buffers.Clear(); !s.ok()) return s;
    const Clock::time_point start = Clock::now();
    absl::StatusOr<RestoreResult> restored = (*client)->Restore();
    if (!restored.ok()) return restored.status();
    best_restore = std::min(best_restore, Seconds(start, Clock::now()));
    if (restored->step != kRounds + 1) {
      return absl::InternalError(
          absl::StrCat("restored step ", restored->step, ", not ", kRounds + 1));
    }
  }
  if (absl::Status s = buffers.CheckRestored(); !s.ok()) return s;
  // The pinned buffer holds the restored bytes, out of the cache like the pool's.
  absl::StatusOr<double> crc = BestOf(
      [&] { return CrcOfChunks(static_cast<const uint8_t*>(buffers.pinned), threads); });
  if (!crc.ok()) return crc.status();

  const double gigabytes = kBytes / 1e9;
  const double download = copies.download, upload = copies.upload;
  const std::string with = absl::StrCat(threads, " capture threads");
  report.Add({"gpu", absl::StrCat("CUDA-IPC capture 1 GiB into pinned pool (+CRC), ", with),
              gigabytes / best_capture, "GB/s", "cudaMemcpy D2H 1 GiB, pinned",
              gigabytes / download, download / best_capture});
  report.Add({"gpu", absl::StrCat("restore 1 GiB into GPU memory (+CRC check), ", with),
              gigabytes / best_restore, "GB/s", "cudaMemcpy H2D 1 GiB, pinned", gigabytes / upload,
              upload / best_restore});
  // A restore checks every byte of the pool, read from memory: it cannot beat the threads' CRC.
  const double restore_limit = std::max(upload, *crc);
  report.Add({"gpu", absl::StrCat("restore 1 GiB into GPU memory (+CRC check), ", with),
              gigabytes / best_restore, "GB/s", "slower of H2D and the threads' CRC-32C",
              gigabytes / restore_limit, restore_limit / best_restore});
  report.Add({"gpu",
              absl::StrCat("CRC-32C alone (ISA-L) of 1 GiB per 4 MiB, ", threads, " threads"),
              gigabytes / *crc, "GB/s", "cudaMemcpy D2H 1 GiB, pinned", gigabytes / download,
              download / *crc});
  if (threads != kCaptureThreads) return absl::OkStatus();
  const double median_blocking = Median(blocking);
  report.Add({"gpu", "Snapshot() blocking, median (16 GPU regions)", median_blocking, "ms",
              "capture time of the step", best_capture * 1e3,
              median_blocking / (best_capture * 1e3)});
  return MeasureManyTensors(daemon, report);
}

}  // namespace

absl::Status RunGpuSuite(Report& report) {
  int devices = 0;
  if (cudaError_t error = cudaGetDeviceCount(&devices); error != cudaSuccess || devices == 0) {
    return absl::UnavailableError(
        absl::StrCat("no usable CUDA device: ", cudaGetErrorString(error)));
  }
  cudaDeviceProp properties{};
  if (absl::Status s =
          CudaCheck(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
      !s.ok()) {
    return s;
  }
  Buffers buffers;
  if (absl::Status s = buffers.Allocate(kBytes); !s.ok()) return s;
  absl::StatusOr<CopyTimes> copies = buffers.TimeCopies();
  if (!copies.ok()) return copies.status();
  for (int threads : {kCaptureThreads, kManyCaptureThreads}) {
    if (absl::Status s = MeasureOneGiB(threads, buffers, *copies, report); !s.ok()) return s;
  }
  report.AddNote("gpu", absl::StrCat(
                            properties.name, ". A moesnapd process (its pool locked and "
                            "cudaHostRegister'ed) and this process as the trainer: 16 regions of "
                            "64 MiB in one cudaMalloc block shared by CUDA IPC, registered in one "
                            "call. The daemon waits on the trainer's IPC event, copies with "
                            "cudaMemcpyAsync on a stream per capture thread, a 4 MiB chunk per "
                            "task queued whole in 1 MiB groups, and computes or checks the CRC-32C "
                            "of each group while the next ones move. Best of ", kRounds,
                            " steps, restores and cudaMemcpy calls; a restore is timed from the "
                            "call to its return, the whole 1 GiB checked after."));
  return absl::OkStatus();
}

}  // namespace moesnap::bench
