// GPU regions over the CUDA driver API: cuIpcGetMemHandle of the allocation, and one interprocess
// event per region, recorded on the region's stream at each Snapshot so the daemon copies only
// after the optimizer step that wrote the region has run. Every driver call runs in the device's primary
// context (the one CUDA runtimes use), pushed for the call and popped after, so the trainer's
// current device and context are left as they were.
#include "client/src/device_regions.h"

#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace moesnap {

struct DeviceRegions::State {
  DriverLoader load_driver;
  std::mutex mutex;  // guards everything below
  const CudaDriver* driver = nullptr;
  struct Region {
    CuEvent event;
    CuStream stream;
    int device;
  };
  std::map<std::string, Region> regions;
  struct PrimaryContext {
    CuDevice device;
    CuContext context;
  };
  std::map<int, PrimaryContext> primary_contexts;  // retained, by device ordinal

  absl::Status Failed(const std::string& name, const char* call, CuResult error) const {
    return absl::InternalError(absl::StrCat("GPU region '", name, "': ",
                                            driver->Describe(call, error)));
  }

  // Runs `call` with the primary context of `device` current on this thread.
  template <typename Call>
  absl::Status InContext(const std::string& name, int device, Call call) {
    auto primary = primary_contexts.find(device);
    if (primary == primary_contexts.end()) {
      PrimaryContext retained{};
      if (CuResult error = driver->device_get(&retained.device, device); error != 0) {
        return Failed(name, "cuDeviceGet", error);
      }
      if (CuResult error = driver->primary_context_retain(&retained.context, retained.device);
          error != 0) {
        return Failed(name, "cuDevicePrimaryCtxRetain", error);
      }
      primary = primary_contexts.emplace(device, retained).first;
    }
    if (CuResult error = driver->context_push(primary->second.context); error != 0) {
      return Failed(name, "cuCtxPushCurrent", error);
    }
    absl::Status status = call();
    CuContext popped = nullptr;
    if (CuResult error = driver->context_pop(&popped); error != 0 && status.ok()) {
      status = Failed(name, "cuCtxPopCurrent", error);
    }
    return status;
  }
};

DeviceRegions::DeviceRegions(DriverLoader load_driver) : state_(std::make_unique<State>()) {
  state_->load_driver = std::move(load_driver);
}

DeviceRegions::~DeviceRegions() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->driver == nullptr) return;
  // Events belong to their context, whichever is current: they are destroyed before the contexts
  // are released.
  for (const auto& [name, region] : state_->regions) state_->driver->event_destroy(region.event);
  for (const auto& [ordinal, primary] : state_->primary_contexts) {
    state_->driver->primary_context_release(primary.device);
  }
}

absl::StatusOr<v1::RegionHandle> DeviceRegions::Share(const std::string& name,
                                                      const DeviceMemory& memory) {
  if (memory.allocation_base == nullptr || memory.bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU region '", name, "' needs an allocation base and a size"));
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->driver == nullptr) {
    absl::StatusOr<const CudaDriver*> driver = state_->load_driver();
    if (!driver.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("GPU region '", name, "': ", driver.status().message()));
    }
    state_->driver = *driver;
  }
  const CudaDriver& driver = *state_->driver;
  v1::RegionHandle handle;
  CuEvent event = nullptr;
  absl::Status status = state_->InContext(name, memory.device, [&]() -> absl::Status {
    CuIpcMemHandle memory_handle;
    if (CuResult error = driver.ipc_get_memory_handle(
            &memory_handle, reinterpret_cast<CuDevicePointer>(memory.allocation_base));
        error != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "GPU region '", name, "': ", driver.Describe("cuIpcGetMemHandle", error),
          " (is allocation_base the pointer cudaMalloc returned?)"));
    }
    if (CuResult error = driver.event_create(&event, kCuEventDisableTiming | kCuEventInterprocess);
        error != 0) {
      return state_->Failed(name, "cuEventCreate", error);
    }
    CuIpcEventHandle event_handle;
    if (CuResult error = driver.ipc_get_event_handle(&event_handle, event); error != 0) {
      driver.event_destroy(event);
      return state_->Failed(name, "cuIpcGetEventHandle", error);
    }
    handle.set_cuda_memory_handle(memory_handle.reserved, sizeof(memory_handle.reserved));
    handle.set_cuda_event_handle(event_handle.reserved, sizeof(event_handle.reserved));
    if (auto old = state_->regions.find(name); old != state_->regions.end()) {
      driver.event_destroy(old->second.event);
    }
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  handle.set_cuda_offset(memory.offset);
  handle.set_cuda_device(memory.device);
  state_->regions[name] = {event, static_cast<CuStream>(memory.stream), memory.device};
  return handle;
}

absl::Status DeviceRegions::RecordCaptureEvents(const std::vector<std::string>& names) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto record = [&](const std::string& name, const State::Region& region) {
    return state_->InContext(name, region.device, [&]() -> absl::Status {
      if (CuResult error = state_->driver->event_record(region.event, region.stream); error != 0) {
        return state_->Failed(name, "cuEventRecord", error);
      }
      return absl::OkStatus();
    });
  };
  if (names.empty()) {
    for (const auto& [name, region] : state_->regions) {
      if (absl::Status status = record(name, region); !status.ok()) return status;
    }
    return absl::OkStatus();
  }
  for (const std::string& name : names) {
    auto it = state_->regions.find(name);
    if (it == state_->regions.end()) continue;  // a host region
    if (absl::Status status = record(name, it->second); !status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace moesnap
