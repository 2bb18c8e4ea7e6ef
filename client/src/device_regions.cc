// GPU regions over the CUDA driver API: the allocation holding each region (cuMemGetAddressRange)
// and its cuIpcGetMemHandle, and one interprocess event per stream the regions are written on,
// recorded on that stream at each Snapshot so the daemon copies only after the optimizer step that
// wrote the regions has run. Every driver call runs in the device's primary context (the one CUDA
// runtimes use), pushed for the call and popped after, so the trainer's current device and context
// are left as they were.
#include "client/src/device_regions.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moesnap {

struct DeviceRegions::State {
  DriverLoader load_driver;
  std::mutex mutex;  // guards everything below
  const CudaDriver* driver = nullptr;
  // One interprocess event per stream the trainer's regions are written on, shared by every region
  // of that stream: a Snapshot records each once, however many regions it covers, and the daemon
  // opens each once.
  using StreamKey = std::pair<int, CuStream>;  // device ordinal, stream
  struct StreamEvent {
    CuEvent event = nullptr;
    std::string handle;  // its CUipcEventHandle
    int regions = 0;     // registered regions using it
    int pending = 0;     // regions shared with it whose registration has not ended yet
  };
  std::map<StreamKey, StreamEvent> stream_events;
  std::map<std::string, StreamKey> regions;  // GPU region name -> its stream
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

  // The event of `key`'s stream, created (in the device's primary context) for its first region.
  absl::StatusOr<StreamEvent*> EventOf(const std::string& name, const StreamKey& key) {
    auto it = stream_events.find(key);
    if (it != stream_events.end()) return &it->second;
    StreamEvent created;
    absl::Status status = InContext(name, key.first, [&]() -> absl::Status {
      if (CuResult error =
              driver->event_create(&created.event, kCuEventDisableTiming | kCuEventInterprocess);
          error != 0) {
        return Failed(name, "cuEventCreate", error);
      }
      CuIpcEventHandle event_handle;
      if (CuResult error = driver->ipc_get_event_handle(&event_handle, created.event); error != 0) {
        driver->event_destroy(created.event);
        return Failed(name, "cuIpcGetEventHandle", error);
      }
      created.handle.assign(event_handle.reserved, sizeof(event_handle.reserved));
      return absl::OkStatus();
    });
    if (!status.ok()) return status;
    return &stream_events.emplace(key, created).first->second;
  }

  // Destroys the event of `key` once nothing uses it or waits to.
  void ReleaseIfUnused(const StreamKey& key) {
    auto event = stream_events.find(key);
    if (event != stream_events.end() && event->second.regions == 0 &&
        event->second.pending == 0) {
      driver->event_destroy(event->second.event);
      stream_events.erase(event);
    }
  }

  // `name` no longer uses its stream's event.
  void Forget(const std::string& name) {
    auto region = regions.find(name);
    if (region == regions.end()) return;
    const StreamKey key = region->second;
    regions.erase(region);
    --stream_events.at(key).regions;
    ReleaseIfUnused(key);
  }

  static StreamKey KeyOf(const DeviceMemory& memory) {
    return {memory.device, static_cast<CuStream>(memory.stream)};
  }

  // Ends the pending share of the first `count` regions: `kept` moves each name to its stream's
  // event; otherwise the names keep what they had.
  void EndShare(const std::vector<std::pair<std::string, DeviceMemory>>& shared, size_t count,
                bool kept) {
    for (size_t i = 0; i < count; ++i) {
      const auto& [name, memory] = shared[i];
      const StreamKey key = KeyOf(memory);
      StreamEvent& event = stream_events.at(key);
      --event.pending;
      if (kept) {
        ++event.regions;  // before Forget, which may release the old stream's event
        Forget(name);
        regions[name] = key;
      }
      ReleaseIfUnused(key);
    }
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
  for (const auto& [key, stream_event] : state_->stream_events) {
    state_->driver->event_destroy(stream_event.event);
  }
  for (const auto& [ordinal, primary] : state_->primary_contexts) {
    state_->driver->primary_context_release(primary.device);
  }
}

absl::StatusOr<std::vector<v1::RegionHandle>> DeviceRegions::Share(
    const std::vector<std::pair<std::string, DeviceMemory>>& regions) {
  for (const auto& [name, memory] : regions) {
    if (memory.address == nullptr || memory.bytes == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPU region '", name, "' needs an address and a size"));
    }
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->driver == nullptr && !regions.empty()) {
    absl::StatusOr<const CudaDriver*> driver = state_->load_driver();
    if (!driver.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("GPU region '", regions.front().first, "': ", driver.status().message()));
    }
    state_->driver = *driver;
  }
  std::vector<v1::RegionHandle> handles;
  handles.reserve(regions.size());
  // The allocation exported last, and its handle: the tensors of a batch mostly lie in a few
  // allocations, each exported once.
  std::pair<int, CuDevicePointer> exported{-1, 0};
  std::string exported_handle;
  // A failure ends the pending share of the regions before it.
  auto abandon = [&](size_t shared, absl::Status status) {
    state_->EndShare(regions, shared, /*kept=*/false);
    return status;
  };
  for (size_t i = 0; i < regions.size(); ++i) {
    const std::string& name = regions[i].first;  // not structured bindings: a lambda captures them
    const DeviceMemory& memory = regions[i].second;
    const State::StreamKey key = State::KeyOf(memory);
    v1::RegionHandle& handle = handles.emplace_back();
    absl::Status status = state_->InContext(name, memory.device, [&]() -> absl::Status {
      // An IPC handle is of a whole allocation, which may start before the region.
      const CuDevicePointer address = reinterpret_cast<CuDevicePointer>(memory.address);
      CuDevicePointer base = 0;
      size_t allocation_bytes = 0;
      if (CuResult error = state_->driver->memory_address_range(&base, &allocation_bytes, address);
          error != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "GPU region '%s': 0x%x on device %d is not device memory (%s)", name, address,
            memory.device, state_->driver->Describe("cuMemGetAddressRange", error)));
      }
      const uint64_t offset = address - base;
      if (memory.bytes > allocation_bytes - offset) {
        return absl::InvalidArgumentError(absl::StrCat(
            "GPU region '", name, "' is ", memory.bytes, " bytes at offset ", offset,
            " of a CUDA allocation of ", allocation_bytes, " bytes"));
      }
      if (exported != std::make_pair(memory.device, base)) {
        CuIpcMemHandle memory_handle;
        if (CuResult error = state_->driver->ipc_get_memory_handle(&memory_handle, base);
            error != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "GPU region '", name, "': ", state_->driver->Describe("cuIpcGetMemHandle", error),
              " (memory from cudaMalloc can be shared; from a virtual memory pool it cannot)"));
        }
        exported = {memory.device, base};
        exported_handle.assign(memory_handle.reserved, sizeof(memory_handle.reserved));
      }
      handle.set_cuda_memory_handle(exported_handle);
      handle.set_cuda_offset(offset);
      return absl::OkStatus();
    });
    if (!status.ok()) return abandon(i, status);
    absl::StatusOr<State::StreamEvent*> event = state_->EventOf(name, key);
    if (!event.ok()) return abandon(i, event.status());
    ++(*event)->pending;
    handle.set_cuda_event_handle((*event)->handle);
    handle.set_cuda_device(memory.device);
  }
  return handles;
}

void DeviceRegions::EndShare(const std::vector<std::pair<std::string, DeviceMemory>>& regions,
                             bool registered) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->driver != nullptr) state_->EndShare(regions, regions.size(), registered);
}

absl::Status DeviceRegions::RecordCaptureEvents(const std::vector<std::string>& names) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  std::vector<std::pair<const std::string*, State::StreamKey>> streams;  // a region naming each
  if (names.empty()) {
    for (const auto& [key, stream_event] : state_->stream_events) {
      streams.emplace_back(nullptr, key);
    }
  } else {
    for (const std::string& name : names) {
      auto it = state_->regions.find(name);
      if (it == state_->regions.end()) continue;  // a host region
      streams.emplace_back(&it->first, it->second);
    }
    std::sort(streams.begin(), streams.end(),
              [](const auto& a, const auto& b) { return a.second < b.second; });
    streams.erase(std::unique(streams.begin(), streams.end(),
                              [](const auto& a, const auto& b) { return a.second == b.second; }),
                  streams.end());
  }
  for (const auto& entry : streams) {
    const std::string* name = entry.first;  // not structured bindings: the lambda captures these
    const State::StreamKey& key = entry.second;
    const State::StreamEvent& stream_event = state_->stream_events.at(key);
    const std::string& label = name != nullptr ? *name : "(every GPU region)";
    absl::Status status = state_->InContext(label, key.first, [&]() -> absl::Status {
      if (CuResult error = state_->driver->event_record(stream_event.event, key.second);
          error != 0) {
        return state_->Failed(label, "cuEventRecord", error);
      }
      return absl::OkStatus();
    });
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace moesnap
