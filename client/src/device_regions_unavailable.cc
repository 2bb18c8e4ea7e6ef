// Built when the build has no CUDA toolkit: no GPU region can be shared.
#include "client/src/device_regions.h"

namespace moesnap {
namespace {

class NoDeviceRegions : public DeviceRegions {
 public:
  absl::StatusOr<v1::RegionHandle> Share(const std::string& name, const DeviceMemory&) override {
    return absl::UnimplementedError("region '" + name +
                                    "': this libmoesnap was built without CUDA");
  }
  absl::Status RecordCaptureEvents(const std::vector<std::string>&) override {
    return absl::OkStatus();  // no GPU regions, nothing to record
  }
};

}  // namespace

std::unique_ptr<DeviceRegions> CreateDeviceRegions() { return std::make_unique<NoDeviceRegions>(); }

}  // namespace moesnap
