// The gpu suite: a real moesnapd process captures 1 GiB of this process's device memory, shared by
// CUDA IPC, into its pinned pool, and restores it; beside cudaMemcpy of the same bytes between the
// device and pinned memory in this process, in the same run. The daemon runs as its own process,
// as in production: a CUDA IPC handle cannot be opened by the process that made it. UNAVAILABLE,
// with the reason, where no GPU is usable.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "bench/suites.h"
#include "moesnap/client.h"
#include "tests/testing/test_daemon.h"

namespace moesnap::bench {
namespace {

constexpr size_t kBytes = size_t{1} << 30;
constexpr int kRegions = 16;
constexpr int kRounds = 10;
constexpr uint8_t kPattern = 0x5a;
using Clock = std::chrono::steady_clock;

absl::Status CudaCheck(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

double Seconds(Clock::time_point start, Clock::time_point end) {
  return std::chrono::duration<double>(end - start).count();
}

// Device memory and a pinned host buffer of kBytes each, freed at the end of the suite.
struct Buffers {
  void* device = nullptr;
  void* pinned = nullptr;
  ~Buffers() {
    if (pinned != nullptr) cudaFreeHost(pinned);
    if (device != nullptr) cudaFree(device);
  }
};

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

}  // namespace

absl::Status RunGpuSuite(Report& report) {
  int devices = 0;
  if (cudaError_t error = cudaGetDeviceCount(&devices); error != cudaSuccess || devices == 0) {
    return absl::UnavailableError(absl::StrCat("no usable CUDA device: ", cudaGetErrorString(error)));
  }
  cudaDeviceProp properties{};
  if (absl::Status s = CudaCheck(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
      !s.ok()) {
    return s;
  }
  // The pool holds the committed step and the one being captured; pinned as in production.
  testing::TestDaemon daemon(absl::StrCat((2 * kBytes >> 20) + 64, "MiB"), "", 0, "required");
  if (!daemon.Start()) return absl::InternalError("moesnapd did not start");
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.socket_path = daemon.agent_socket(), .rank = 0});
  if (!client.ok()) return client.status();

  Buffers buffers;
  if (absl::Status s = CudaCheck(cudaMalloc(&buffers.device, kBytes), "cudaMalloc"); !s.ok()) return s;
  if (absl::Status s = CudaCheck(cudaMallocHost(&buffers.pinned, kBytes), "cudaMallocHost"); !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaCheck(cudaMemset(buffers.device, kPattern, kBytes), "cudaMemset"); !s.ok()) {
    return s;
  }
  for (int region = 0; region < kRegions; ++region) {
    if (absl::Status s = (*client)->RegisterDeviceRegion(
            {absl::StrCat("expert", region), "bfloat16", {}},
            {0, buffers.device, region * (kBytes / kRegions), kBytes / kRegions, nullptr});
        !s.ok()) {
      return s;
    }
  }

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
  absl::StatusOr<double> best_download = BestOf([&] {
    return CudaCheck(cudaMemcpy(buffers.pinned, buffers.device, kBytes, cudaMemcpyDeviceToHost),
                     "cudaMemcpy device to host");
  });
  if (!best_download.ok()) return best_download.status();

  // Restore: the committed step back into device memory that was cleared first, checked whole.
  double best_restore = 1e9;
  for (int round = 0; round < kRounds; ++round) {
    if (absl::Status s = CudaCheck(cudaMemset(buffers.device, 0, kBytes), "cudaMemset"); !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaCheck(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); !s.ok()) {
      return s;
    }
    const Clock::time_point start = Clock::now();
    absl::StatusOr<RestoreResult> restored = (*client)->Restore();
    if (!restored.ok()) return restored.status();
    best_restore = std::min(best_restore, Seconds(start, Clock::now()));
    if (restored->step != kRounds + 1) {
      return absl::InternalError(absl::StrCat("restored step ", restored->step, ", not ", kRounds + 1));
    }
  }
  if (absl::Status s = CudaCheck(
          cudaMemcpy(buffers.pinned, buffers.device, kBytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
      !s.ok()) {
    return s;
  }
  const uint8_t* back = static_cast<const uint8_t*>(buffers.pinned);
  if (back[0] != kPattern || std::memcmp(back, back + 1, kBytes - 1) != 0) {
    return absl::DataLossError("the restored device memory differs from what was captured");
  }
  absl::StatusOr<double> best_upload = BestOf([&] {
    return CudaCheck(cudaMemcpy(buffers.device, buffers.pinned, kBytes, cudaMemcpyHostToDevice),
                     "cudaMemcpy host to device");
  });
  if (!best_upload.ok()) return best_upload.status();

  std::sort(blocking.begin(), blocking.end());
  const double gigabytes = kBytes / 1e9;
  const double median_blocking = blocking[blocking.size() / 2];
  report.Add({"gpu", "CUDA-IPC capture 1 GiB into pinned pool (+CRC)", gigabytes / best_capture,
              "GB/s", "cudaMemcpy D2H 1 GiB, pinned", gigabytes / *best_download,
              *best_download / best_capture});
  report.Add({"gpu", "Snapshot() blocking, median (16 GPU regions)", median_blocking, "ms",
              "capture time of the step", best_capture * 1e3, median_blocking / (best_capture * 1e3)});
  report.Add({"gpu", "restore 1 GiB from pinned pool into GPU memory (+CRC check)",
              gigabytes / best_restore, "GB/s", "cudaMemcpy H2D 1 GiB, pinned",
              gigabytes / *best_upload, *best_upload / best_restore});
  report.AddNote("gpu", absl::StrCat(
                            properties.name, ". A moesnapd process (2 capture threads, pool locked "
                            "and cudaHostRegister'ed) and this process as the trainer: 16 regions "
                            "in one cudaMalloc block shared by CUDA IPC. The daemon waits on the "
                            "trainer's IPC event, copies with cudaMemcpyAsync on a stream per "
                            "thread in 4 MiB chunks and computes or checks the CRC-32C of each. "
                            "Best of ", kRounds, " steps (restores) and of ", kRounds,
                            " cudaMemcpy calls; a restore is timed from the call to its return, "
                            "the whole 1 GiB checked after."));
  return absl::OkStatus();
}

}  // namespace moesnap::bench
