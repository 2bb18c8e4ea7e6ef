// The trainer-side half of GPU regions: IPC handles for the daemon, and the capture events recorded
// on the trainer's streams at each Snapshot, through the CUDA driver. The driver is loaded when the
// first region is shared, never before, so a trainer without GPU regions never needs CUDA.
#ifndef MOESNAP_CLIENT_SRC_DEVICE_REGIONS_H_
#define MOESNAP_CLIENT_SRC_DEVICE_REGIONS_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
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

  // Exports each named region's memory for the daemon, in order: the IPC memory handle of the
  // allocation holding it, and the IPC event of its stream, made for the first region of that
  // stream and shared by every later one. FAILED_PRECONDITION when there is no CUDA driver. A
  // successful Share must be followed by EndShare of the same regions once the daemon has taken
  // or refused them.
  absl::StatusOr<std::vector<v1::RegionHandle>> Share(
      const std::vector<std::pair<std::string, DeviceMemory>>& regions);
  // `registered`: the regions are the daemon's now, each name using its new stream's event (the
  // event of an earlier region of the name is released when nothing else uses it). Otherwise
  // every name keeps the event it had, and events made for the share alone are released.
  void EndShare(const std::vector<std::pair<std::string, DeviceMemory>>& regions, bool registered);
  // Records, on each stream, the capture event of the named regions (all when empty), once per
  // stream however many regions share it; names of host regions are passed over.
  absl::Status RecordCaptureEvents(const std::vector<std::string>& names);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SRC_DEVICE_REGIONS_H_
