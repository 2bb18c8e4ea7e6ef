// GPU regions with the CUDA runtime: cudaIpcGetMemHandle of the allocation, and one interprocess
// event per region, recorded on the region's stream at each Snapshot so the daemon copies only after
// the optimizer step that wrote the region has run.
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "client/src/device_regions.h"

namespace moesnap {
namespace {

absl::Status CudaError(cudaError_t error, const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error), " (",
                                          cudaGetErrorString(error), ")"));
}

class CudaDeviceRegions : public DeviceRegions {
 public:
  ~CudaDeviceRegions() override {
    for (auto& [name, region] : regions_) cudaEventDestroy(region.event);
  }

  absl::StatusOr<v1::RegionHandle> Share(const std::string& name,
                                         const DeviceMemory& memory) override {
    if (memory.allocation_base == nullptr || memory.bytes == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("region '", name, "' needs an allocation base and a size"));
    }
    if (cudaError_t error = cudaSetDevice(memory.device); error != cudaSuccess) {
      return CudaError(error, absl::StrCat("region '", name, "': cudaSetDevice"));
    }
    cudaIpcMemHandle_t memory_handle;
    if (cudaError_t error = cudaIpcGetMemHandle(&memory_handle, memory.allocation_base);
        error != cudaSuccess) {
      return CudaError(error, absl::StrCat("region '", name,
                                           "': cudaIpcGetMemHandle (is allocation_base the "
                                           "pointer cudaMalloc returned?)"));
    }
    cudaEvent_t event = nullptr;
    if (cudaError_t error =
            cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess);
        error != cudaSuccess) {
      return CudaError(error, absl::StrCat("region '", name, "': cudaEventCreate"));
    }
    cudaIpcEventHandle_t event_handle;
    if (cudaError_t error = cudaIpcGetEventHandle(&event_handle, event); error != cudaSuccess) {
      cudaEventDestroy(event);
      return CudaError(error, absl::StrCat("region '", name, "': cudaIpcGetEventHandle"));
    }
    v1::RegionHandle handle;
    handle.set_cuda_memory_handle(reinterpret_cast<const char*>(&memory_handle),
                                  sizeof(memory_handle));
    handle.set_cuda_offset(memory.offset);
    handle.set_cuda_device(memory.device);
    handle.set_cuda_event_handle(reinterpret_cast<const char*>(&event_handle), sizeof(event_handle));
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto old = regions_.find(name); old != regions_.end()) cudaEventDestroy(old->second.event);
    regions_[name] = {event, static_cast<cudaStream_t>(memory.stream), memory.device};
    return handle;
  }

  absl::Status RecordCaptureEvents(const std::vector<std::string>& names) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto record = [](const std::string& name, const Region& region) -> absl::Status {
      if (cudaError_t error = cudaSetDevice(region.device); error != cudaSuccess) {
        return CudaError(error, absl::StrCat("region '", name, "': cudaSetDevice"));
      }
      if (cudaError_t error = cudaEventRecord(region.event, region.stream); error != cudaSuccess) {
        return CudaError(error, absl::StrCat("region '", name, "': cudaEventRecord"));
      }
      return absl::OkStatus();
    };
    if (names.empty()) {
      for (const auto& [name, region] : regions_) {
        if (absl::Status status = record(name, region); !status.ok()) return status;
      }
      return absl::OkStatus();
    }
    for (const std::string& name : names) {
      auto it = regions_.find(name);
      if (it == regions_.end()) continue;  // a host region
      if (absl::Status status = record(name, it->second); !status.ok()) return status;
    }
    return absl::OkStatus();
  }

 private:
  struct Region {
    cudaEvent_t event;
    cudaStream_t stream;
    int device;
  };
  std::mutex mutex_;
  std::map<std::string, Region> regions_;
};

}  // namespace

std::unique_ptr<DeviceRegions> CreateDeviceRegions() {
  return std::make_unique<CudaDeviceRegions>();
}

}  // namespace moesnap
