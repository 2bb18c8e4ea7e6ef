// The trainer-side half of GPU regions: IPC handles for the daemon, and the capture events recorded
// on the trainer's streams at each Snapshot, through the CUDA driver. The driver is loaded when the
// first region is shared, never before, so a trainer without GPU regions never needs CUDA.
#ifndef MOESNAP_CLIENT_SRC_DEVICE_REGIONS_H_
#define MOESNAP_CLIENT_SRC_DEVICE_REGIONS_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/src/cuda_driver.h"
#include "moesnap/client.h"
#include "proto/moesnap.pb.h"

namespace moesnap {

// Thread-safe.
class DeviceRegions {
 public:
  using DriverLoader = std::function<absl::StatusOr<const CudaDriver*>()>;
  // `load_driver` is called at the first Share (tests pass a fake driver).
  explicit DeviceRegions(DriverLoader load_driver = LoadCudaDriver);
  ~DeviceRegions();
  DeviceRegions(const DeviceRegions&) = delete;
  DeviceRegions& operator=(const DeviceRegions&) = delete;

  // Exports `memory` for the daemon: its IPC memory handle and a fresh IPC event (replacing the
  // event of an earlier region of that name). FAILED_PRECONDITION when there is no CUDA driver.
  absl::StatusOr<v1::RegionHandle> Share(const std::string& name, const DeviceMemory& memory);
  // Records the capture event of each named region (all when empty) on its stream; names of
  // host regions are passed over.
  absl::Status RecordCaptureEvents(const std::vector<std::string>& names);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SRC_DEVICE_REGIONS_H_
