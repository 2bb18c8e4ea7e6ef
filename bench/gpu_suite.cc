// The gpu suite: CUDA-IPC capture by a real daemon (in this process, over its Unix socket) of 1 GiB
// of device memory into its pinned pool, beside cudaMemcpy device-to-host of the same bytes into
// pinned memory in the same run. UNAVAILABLE, with the reason, where no GPU is usable.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "bench/suites.h"
#include "common/shared_memory.h"
#include "daemon/daemon.h"
#include "moesnap/client.h"

namespace moesnap::bench {
namespace {

constexpr size_t kBytes = size_t{1} << 30;
constexpr int kRounds = 10;
using Clock = std::chrono::steady_clock;

absl::Status CudaCheck(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

}  // namespace

absl::Status RunGpuSuite(Report& report) {
  int devices = 0;
  if (cudaError_t error = cudaGetDeviceCount(&devices); error != cudaSuccess || devices == 0) {
    return absl::UnavailableError(absl::StrCat("no usable CUDA device: ", cudaGetErrorString(error)));
  }
  const std::string directory = absl::StrCat("/tmp/moesnap-bench-gpu-", getpid());
  std::filesystem::create_directories(directory);
  daemon::DaemonOptions options;
  options.agent_socket = directory + "/agent.sock";
  options.admin_socket = directory + "/admin.sock";
  options.http.address = "";  // a benchmark serves no metrics
  options.pool.name = absl::StrCat("moesnap-bench-gpu-", getpid());
  options.pool.bytes = 2 * kBytes + (64 << 20);
  options.pool.journal_bytes = 1 << 20;
  options.pool.lock = daemon::PoolLockMode::kRequired;  // cudaHostRegister: pinned, as in production
  options.capture.threads = 2;
  absl::Status status;
  {
    absl::StatusOr<std::unique_ptr<daemon::Daemon>> daemon = daemon::Daemon::Start(options);
    if (!daemon.ok()) return daemon.status();
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.socket_path = options.agent_socket, .rank = 0});
    if (!client.ok()) return client.status();
    void* device = nullptr;
    if (absl::Status s = CudaCheck(cudaMalloc(&device, kBytes), "cudaMalloc"); !s.ok()) return s;
    status.Update(CudaCheck(cudaMemset(device, 0x5a, kBytes), "cudaMemset"));
    constexpr int kRegions = 16;
    for (int region = 0; region < kRegions && status.ok(); ++region) {
      status.Update((*client)->RegisterDeviceRegion(
          {absl::StrCat("expert", region), "bfloat16", {}},
          {0, device, region * (kBytes / kRegions), kBytes / kRegions, nullptr}));
    }
    double best_capture = 1e9, best_copy = 1e9;
    std::vector<double> blocking;
    void* pinned = nullptr;
    status.Update(CudaCheck(cudaMallocHost(&pinned, kBytes), "cudaMallocHost"));
    for (int round = 0; round < kRounds + 1 && status.ok(); ++round) {
      const Clock::time_point start = Clock::now();
      absl::StatusOr<uint64_t> bytes = (*client)->Snapshot(round + 1);
      const Clock::time_point returned = Clock::now();
      status.Update(bytes.status());
      if (status.ok()) status.Update((*client)->WaitCaptured(round + 1));
      const Clock::time_point captured = Clock::now();
      if (round > 0) {  // the first round opens the IPC handles
        best_capture = std::min(best_capture, std::chrono::duration<double>(captured - start).count());
        blocking.push_back(std::chrono::duration<double, std::milli>(returned - start).count());
      }
      const Clock::time_point copy_start = Clock::now();
      status.Update(CudaCheck(cudaMemcpy(pinned, device, kBytes, cudaMemcpyDeviceToHost), "cudaMemcpy"));
      best_copy = std::min(best_copy, std::chrono::duration<double>(Clock::now() - copy_start).count());
    }
    cudaFreeHost(pinned);
    cudaFree(device);
    if (status.ok()) {
      std::sort(blocking.begin(), blocking.end());
      const double gigabytes = kBytes / 1e9;
      report.Add({"gpu", "CUDA-IPC capture 1 GiB into pinned pool (+CRC)", gigabytes / best_capture,
                  "GB/s", "cudaMemcpy D2H 1 GiB, pinned", gigabytes / best_copy,
                  best_copy / best_capture});
      report.Add({"gpu", "Snapshot() blocking, median (16 GPU regions)", blocking[blocking.size() / 2],
                  "ms", "capture time of the step", best_capture * 1e3,
                  blocking[blocking.size() / 2] / (best_capture * 1e3)});
      report.AddNote("gpu", "16 regions in one cudaMalloc block shared by CUDA IPC; the daemon waits "
                            "on the trainer's IPC event, copies with cudaMemcpyAsync on 2 streams "
                            "into its cudaHostRegister'ed pool and computes CRC-32C per 4 MiB chunk.");
    }
  }
  std::filesystem::remove_all(directory);
  for (const char* suffix : {".data", ".journal"}) {
    SharedMemory::Unlink(options.pool.name + suffix).IgnoreError();
  }
  return status;
}

}  // namespace moesnap::bench
