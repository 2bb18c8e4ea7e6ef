// The CUDA copy backend: GPU regions arrive as CUDA IPC handles. Each allocation handle and event
// handle is opened once and shared by every region inside it (PyTorch's caching allocator packs many
// tensors into one cudaMalloc block, and a handle may be opened only once per process). Copies wait on
// the trainer's IPC event on the daemon's own stream, then cudaMemcpyAsync into pinned pool memory:
// a batch (a chunk, or a run of small regions) is queued whole in groups of 1 MiB, contiguous
// regions as one copy, and each group's CRC-32C is computed while the next groups move.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/copy_backend.h"
#include "daemon/transfer_groups.h"

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
  const OpenedAllocation* allocation() const { return allocation_.get(); }
  uint8_t* data() const { return static_cast<uint8_t*>(allocation_->base) + offset_; }
  cudaEvent_t event() const { return event_ ? event_->event : nullptr; }

 private:
  std::shared_ptr<OpenedAllocation> allocation_;
  std::shared_ptr<OpenedEvent> event_;
  uint64_t offset_;
  uint64_t bytes_;
};

// A batch moves in groups of this size so that the CRC-32C of one group runs on the CPU while the
// next groups move over PCIe: a batch then takes about the longer of the two, not their sum. A
// group is also small enough to be read back from the last-level cache it was written to.
constexpr uint64_t kGroupBytes = 1 << 20;
constexpr int kGroupsInFlight = 4;

// The calling capture thread's stream on one device, and the events marking where each group in
// flight on it ends; created on first use.
struct Lane {
  cudaStream_t stream = nullptr;
  std::array<cudaEvent_t, kGroupsInFlight> group_done{};
};

absl::StatusOr<Lane*> ThreadLane(int device) {
  thread_local std::map<int, Lane> lanes;
  auto it = lanes.find(device);
  if (it != lanes.end()) return &it->second;
  Lane lane;
  auto release = [&lane] {  // what a failed creation made so far
    for (cudaEvent_t event : lane.group_done) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    if (lane.stream != nullptr) cudaStreamDestroy(lane.stream);
  };
  if (cudaError_t error = cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking);
      error != cudaSuccess) {
    return CudaError(error, "cudaStreamCreateWithFlags");
  }
  for (cudaEvent_t& event : lane.group_done) {
    if (cudaError_t error = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
        error != cudaSuccess) {
      event = nullptr;
      release();
      return CudaError(error, "cudaEventCreateWithFlags");
    }
  }
  return &lanes.emplace(device, lane).first->second;
}

const CudaRegionSource& SourceOf(const Transfer& transfer) {
  return static_cast<const CudaRegionSource&>(*transfer.source);
}

// Queues on the lane's stream one cudaMemcpyAsync per run of `slices` contiguous on both sides in
// one allocation, from the device to the pool or back (`direction`).
absl::Status QueueCopies(const Lane& lane, cudaMemcpyKind direction,
                         std::span<const Transfer> transfers,
                         std::span<const TransferGroups::Slice> slices) {
  return TransferGroups::CopyContiguous(
      transfers, slices,
      [](const Transfer& transfer, uint64_t at) {
        return SourceOf(transfer).data() + transfer.offset + at;
      },
      [](const Transfer& transfer) -> const void* { return SourceOf(transfer).allocation(); },
      [&](uint8_t* device, uint8_t* host, uint64_t bytes) -> absl::Status {
        const bool out = direction == cudaMemcpyDeviceToHost;
        if (cudaError_t error = cudaMemcpyAsync(out ? host : device, out ? device : host, bytes,
                                                direction, lane.stream);
            error != cudaSuccess) {
          return CudaError(error, out ? "cudaMemcpyAsync device to host"
                                      : "cudaMemcpyAsync host to device");
        }
        return absl::OkStatus();
      });
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
    Transfer transfer{&region, offset, destination, bytes, false, crc};
    if (absl::Status status = CopyOutBatch(std::span<Transfer>(&transfer, 1)); !status.ok()) {
      return status;
    }
    return transfer.crc;
  }

  absl::StatusOr<uint32_t> CopyIn(RegionSource& region, uint64_t offset, const uint8_t* origin,
                                  uint64_t bytes, uint32_t crc) override {
    // CopyInBatch only reads the pool.
    Transfer transfer{&region, offset, const_cast<uint8_t*>(origin), bytes, false, crc};
    if (absl::Status status = CopyInBatch(std::span<Transfer>(&transfer, 1)); !status.ok()) {
      return status;
    }
    return transfer.crc;
  }

  absl::Status CopyOutBatch(std::span<Transfer> transfers) override {
    return EachDevice(transfers, [](Lane& lane, std::span<Transfer> batch) {
      return CopyOutOnLane(lane, batch);
    });
  }

  absl::Status CopyInBatch(std::span<Transfer> transfers) override {
    return EachDevice(transfers, [](Lane& lane, std::span<Transfer> batch) {
      return CopyInOnLane(lane, batch);
    });
  }

 private:
  // Runs `copy` on each run of transfers of one device, on the calling thread's lane there.
  template <typename Copy>
  static absl::Status EachDevice(std::span<Transfer> transfers, Copy copy) {
    for (size_t begin = 0; begin < transfers.size();) {
      const int device = SourceOf(transfers[begin]).device();
      size_t end = begin + 1;
      while (end < transfers.size() && SourceOf(transfers[end]).device() == device) ++end;
      if (cudaError_t error = cudaSetDevice(device); error != cudaSuccess) {
        return CudaError(error, "cudaSetDevice");
      }
      absl::StatusOr<Lane*> lane = ThreadLane(device);
      if (!lane.ok()) return lane.status();
      if (absl::Status status = copy(**lane, transfers.subspan(begin, end - begin)); !status.ok()) {
        return status;
      }
      begin = end;
    }
    return absl::OkStatus();
  }

  // Waits for the trainer's capture events (one per stream its regions are written on), queues up
  // to kGroupsInFlight groups of slices ahead, and computes each group's CRCs once it has landed,
  // while the next groups move.
  static absl::Status CopyOutOnLane(Lane& lane, std::span<Transfer> transfers) {
    std::vector<cudaEvent_t> waited;
    for (const Transfer& transfer : transfers) {
      const cudaEvent_t event = SourceOf(transfer).event();
      if (event == nullptr || std::find(waited.begin(), waited.end(), event) != waited.end()) {
        continue;
      }
      // The trainer recorded this event at Snapshot: copy only what its optimizer step wrote.
      if (cudaError_t error = cudaStreamWaitEvent(lane.stream, event, 0); error != cudaSuccess) {
        return CudaError(error, "cudaStreamWaitEvent");
      }
      waited.push_back(event);
    }
    const TransferGroups cut(transfers, kGroupBytes);
    const size_t groups = cut.groups();
    size_t queued = 0;
    auto queue_next = [&]() -> absl::Status {
      if (absl::Status status =
              QueueCopies(lane, cudaMemcpyDeviceToHost, transfers, cut.group(queued));
          !status.ok()) {
        return status;
      }
      if (cudaError_t error =
              cudaEventRecord(lane.group_done[queued % kGroupsInFlight], lane.stream);
          error != cudaSuccess) {
        return CudaError(error, "cudaEventRecord");
      }
      ++queued;
      return absl::OkStatus();
    };
    absl::Status status;
    while (status.ok() && queued < std::min<size_t>(groups, kGroupsInFlight)) status = queue_next();
    for (size_t group = 0; status.ok() && group < groups; ++group) {
      if (cudaError_t error = cudaEventSynchronize(lane.group_done[group % kGroupsInFlight]);
          error != cudaSuccess) {
        status = CudaError(error, "cudaEventSynchronize");
        break;
      }
      TransferGroups::ExtendCrcs(transfers, cut.group(group));
      if (queued < groups) status = queue_next();
    }
    if (!status.ok()) cudaStreamSynchronize(lane.stream);  // nothing may still write the pool
    return status;
  }

  // Checks each group's CRCs, then queues its copy: it moves while the next group is checked.
  static absl::Status CopyInOnLane(Lane& lane, std::span<Transfer> transfers) {
    const TransferGroups cut(transfers, kGroupBytes);
    absl::Status status;
    for (size_t group = 0; status.ok() && group < cut.groups(); ++group) {
      TransferGroups::ExtendCrcs(transfers, cut.group(group));
      status = QueueCopies(lane, cudaMemcpyHostToDevice, transfers, cut.group(group));
    }
    if (cudaError_t error = cudaStreamSynchronize(lane.stream);
        error != cudaSuccess && status.ok()) {
      status = CudaError(error, "cudaStreamSynchronize");
    }
    return status;
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
