// The trainer-side half of GPU regions: IPC handles for the daemon, and the capture events recorded
// on the trainer's streams at each Snapshot. One implementation with CUDA, one that says it has none;
// CMake picks the file, so no call site chooses.
#ifndef MOESNAP_CLIENT_SRC_DEVICE_REGIONS_H_
#define MOESNAP_CLIENT_SRC_DEVICE_REGIONS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moesnap/client.h"
#include "proto/moesnap.pb.h"

namespace moesnap {

class DeviceRegions {
 public:
  virtual ~DeviceRegions() = default;
  // Exports `memory` for the daemon: its IPC memory handle and a fresh IPC event.
  virtual absl::StatusOr<v1::RegionHandle> Share(const std::string& name,
                                                 const DeviceMemory& memory) = 0;
  // Records the capture event of each named region (all when empty) on its stream.
  virtual absl::Status RecordCaptureEvents(const std::vector<std::string>& names) = 0;
};

std::unique_ptr<DeviceRegions> CreateDeviceRegions();

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SRC_DEVICE_REGIONS_H_
