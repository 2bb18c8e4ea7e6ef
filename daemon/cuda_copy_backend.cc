// The CUDA copy backend: GPU regions arrive as CUDA IPC handles. Each allocation handle and event
// handle is opened once and shared by every region inside it (PyTorch's caching allocator packs many
// tensors into one cudaMalloc block, and a handle may be opened only once per process). Copies wait on
// the trainer's IPC event on the daemon's own stream, then cudaMemcpyAsync into pinned pool memory.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/copy_backend.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {
namespace {

absl::Status CudaError(cudaError_t error, const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error), " (",
                                          cudaGetErrorString(error), ")"));
}

// The size of the allocation starting at `base`, as the driver knows it (cuMemGetAddressRange,
// reached through the runtime so that moesnapd does not link the driver library).
absl::StatusOr<uint64_t> AllocationBytes(void* base) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetAddressRange get_address_range = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t error = cudaGetDriverEntryPointByVersion(
        "cuMemGetAddressRange", &function, 12000, cudaEnableDefault, &found);
#elif CUDART_VERSION >= 12000
    const cudaError_t error =
        cudaGetDriverEntryPoint("cuMemGetAddressRange", &function, cudaEnableDefault, &found);
#else
    const cudaError_t error =
        cudaGetDriverEntryPoint("cuMemGetAddressRange", &function, cudaEnableDefault);
    found = cudaDriverEntryPointSuccess;
#endif
    return error == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<GetAddressRange>(function)
               : nullptr;
  }();
  if (get_address_range == nullptr) {
    return absl::InternalError("the CUDA driver has no cuMemGetAddressRange");
  }
  CUdeviceptr start = 0;
  size_t bytes = 0;
  if (CUresult result = get_address_range(&start, &bytes, reinterpret_cast<CUdeviceptr>(base));
      result != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuMemGetAddressRange failed (CUresult ", result, ")"));
  }
  // An IPC handle opens its allocation at the allocation's start.
  return static_cast<uint64_t>(bytes - (reinterpret_cast<CUdeviceptr>(base) - start));
}

// One opened cudaIpcMemHandle_t; closed when the last region inside it is released.
struct OpenedAllocation {
  int device = 0;
  void* base = nullptr;
  uint64_t bytes = 0;  // of the allocation: every region inside it lies within
  ~OpenedAllocation() {
    if (base != nullptr && cudaSetDevice(device) == cudaSuccess) cudaIpcCloseMemHandle(base);
  }
};

struct OpenedEvent {
  cudaEvent_t event = nullptr;
  ~OpenedEvent() {
    if (event != nullptr) cudaEventDestroy(event);
  }
};

class CudaRegionSource : public RegionSource {
 public:
  CudaRegionSource(std::shared_ptr<OpenedAllocation> allocation, std::shared_ptr<OpenedEvent> event,
                   uint64_t offset, uint64_t bytes)
      : allocation_(std::move(allocation)), event_(std::move(event)), offset_(offset), bytes_(bytes) {}
  uint64_t bytes() const override { return bytes_; }
  int device() const { return allocation_->device; }
  uint8_t* data() const { return static_cast<uint8_t*>(allocation_->base) + offset_; }
  cudaEvent_t event() const { return event_ ? event_->event : nullptr; }

 private:
  std::shared_ptr<OpenedAllocation> allocation_;
  std::shared_ptr<OpenedEvent> event_;
  uint64_t offset_;
  uint64_t bytes_;
};

// The calling capture thread's stream on `device`, created on first use.
absl::StatusOr<cudaStream_t> ThreadStream(int device) {
  thread_local std::map<int, cudaStream_t> streams;
  auto it = streams.find(device);
  if (it != streams.end()) return it->second;
  cudaStream_t stream = nullptr;
  if (cudaError_t error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      error != cudaSuccess) {
    return CudaError(error, "cudaStreamCreateWithFlags");
  }
  streams[device] = stream;
  return stream;
}

class CudaCopyBackend : public CopyBackend {
 public:
  std::string name() const override { return "cuda"; }
  bool supports_device_memory() const override { return true; }

  absl::Status PinHostMemory(void* data, uint64_t bytes) override {
    if (cudaError_t error = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
        error != cudaSuccess) {
      return CudaError(error, absl::StrCat("cudaHostRegister of ", bytes, " bytes"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<RegionSource>> Open(uint32_t /*rank*/,
                                                     const v1::RegionSpec& spec) override {
    const v1::RegionHandle& handle = spec.handle();
    if (spec.device() != v1::DEVICE_CUDA) {
      return absl::InvalidArgumentError(absl::StrCat("region '", spec.name(), "' is not GPU memory"));
    }
    if (handle.cuda_memory_handle().size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region '", spec.name(), "': a CUDA IPC memory handle is ", sizeof(cudaIpcMemHandle_t),
          " bytes, got ", handle.cuda_memory_handle().size()));
    }
    if (!handle.cuda_event_handle().empty() &&
        handle.cuda_event_handle().size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region '", spec.name(), "': a CUDA IPC event handle is ", sizeof(cudaIpcEventHandle_t),
          " bytes, got ", handle.cuda_event_handle().size()));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (cudaError_t error = cudaSetDevice(handle.cuda_device()); error != cudaSuccess) {
      return CudaError(error, absl::StrCat("region '", spec.name(), "': cudaSetDevice(",
                                           handle.cuda_device(), ")"));
    }
    std::shared_ptr<OpenedAllocation> allocation = allocations_[handle.cuda_memory_handle()].lock();
    if (allocation == nullptr) {
      cudaIpcMemHandle_t memory_handle;
      std::memcpy(&memory_handle, handle.cuda_memory_handle().data(), sizeof(memory_handle));
      allocation = std::make_shared<OpenedAllocation>();
      allocation->device = handle.cuda_device();
      if (cudaError_t error = cudaIpcOpenMemHandle(&allocation->base, memory_handle,
                                                   cudaIpcMemLazyEnablePeerAccess);
          error != cudaSuccess) {
        allocation->base = nullptr;
        return CudaError(error, absl::StrCat("region '", spec.name(), "': cudaIpcOpenMemHandle"));
      }
      absl::StatusOr<uint64_t> bytes = AllocationBytes(allocation->base);
      if (!bytes.ok()) {
        return absl::Status(bytes.status().code(),
                            absl::StrCat("region '", spec.name(), "': ", bytes.status().message()));
      }
      allocation->bytes = *bytes;
      allocations_[handle.cuda_memory_handle()] = allocation;
    }
    if (handle.cuda_offset() > allocation->bytes ||
        spec.bytes() > allocation->bytes - handle.cuda_offset()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region '", spec.name(), "' is ", spec.bytes(), " bytes at offset ", handle.cuda_offset(),
          " of its CUDA allocation, which holds only ", allocation->bytes, " bytes"));
    }
    std::shared_ptr<OpenedEvent> event;
    if (!handle.cuda_event_handle().empty()) {
      event = events_[handle.cuda_event_handle()].lock();
      if (event == nullptr) {
        cudaIpcEventHandle_t event_handle;
        std::memcpy(&event_handle, handle.cuda_event_handle().data(), sizeof(event_handle));
        event = std::make_shared<OpenedEvent>();
        if (cudaError_t error = cudaIpcOpenEventHandle(&event->event, event_handle);
            error != cudaSuccess) {
          event->event = nullptr;
          return CudaError(error, absl::StrCat("region '", spec.name(), "': cudaIpcOpenEventHandle"));
        }
        events_[handle.cuda_event_handle()] = event;
      }
    }
    return std::make_shared<CudaRegionSource>(std::move(allocation), std::move(event),
                                              handle.cuda_offset(), spec.bytes());
  }

  absl::StatusOr<uint32_t> CopyOut(RegionSource& region, uint64_t offset, uint8_t* destination,
                                   uint64_t bytes, uint32_t crc) override {
    auto& source = static_cast<CudaRegionSource&>(region);
    absl::StatusOr<cudaStream_t> stream = PrepareStream(source);
    if (!stream.ok()) return stream.status();
    if (source.event() != nullptr) {
      // The trainer recorded this event at Snapshot: copy only what its optimizer step wrote.
      if (cudaError_t error = cudaStreamWaitEvent(*stream, source.event(), 0); error != cudaSuccess) {
        return CudaError(error, "cudaStreamWaitEvent");
      }
    }
    if (cudaError_t error = cudaMemcpyAsync(destination, source.data() + offset, bytes,
                                            cudaMemcpyDeviceToHost, *stream);
        error != cudaSuccess) {
      return CudaError(error, "cudaMemcpyAsync device to host");
    }
    if (cudaError_t error = cudaStreamSynchronize(*stream); error != cudaSuccess) {
      return CudaError(error, "cudaStreamSynchronize");
    }
    return erasure::Crc32cExtend(crc, destination, bytes);
  }

  absl::StatusOr<uint32_t> CopyIn(RegionSource& region, uint64_t offset, const uint8_t* origin,
                                  uint64_t bytes, uint32_t crc) override {
    auto& source = static_cast<CudaRegionSource&>(region);
    absl::StatusOr<cudaStream_t> stream = PrepareStream(source);
    if (!stream.ok()) return stream.status();
    crc = erasure::Crc32cExtend(crc, origin, bytes);
    if (cudaError_t error = cudaMemcpyAsync(source.data() + offset, origin, bytes,
                                            cudaMemcpyHostToDevice, *stream);
        error != cudaSuccess) {
      return CudaError(error, "cudaMemcpyAsync host to device");
    }
    if (cudaError_t error = cudaStreamSynchronize(*stream); error != cudaSuccess) {
      return CudaError(error, "cudaStreamSynchronize");
    }
    return crc;
  }

 private:
  static absl::StatusOr<cudaStream_t> PrepareStream(const CudaRegionSource& source) {
    if (cudaError_t error = cudaSetDevice(source.device()); error != cudaSuccess) {
      return CudaError(error, "cudaSetDevice");
    }
    return ThreadStream(source.device());
  }

  std::mutex mutex_;  // guards the two handle caches
  std::map<std::string, std::weak_ptr<OpenedAllocation>> allocations_;
  std::map<std::string, std::weak_ptr<OpenedEvent>> events_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CopyBackend>> CreateCudaCopyBackend() {
  int devices = 0;
  if (cudaError_t error = cudaGetDeviceCount(&devices); error != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("no usable CUDA device: ", cudaGetErrorString(error)));
  }
  if (devices == 0) return absl::UnavailableError("no CUDA device present");
  return std::make_unique<CudaCopyBackend>();
}

}  // namespace moesnap::daemon
