// CheckRegionSpec: each field against its bound; a name too long to print is cut in the message.
#include "daemon/region_limits.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace moesnap::daemon {

absl::Status CheckRegionSpec(const v1::RegionSpec& spec) {
  if (spec.name().empty()) return absl::InvalidArgumentError("a region needs a name");
  if (spec.name().size() > kMaxRegionNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region '", spec.name().substr(0, 64), "...' has a name of ", spec.name().size(),
        " bytes; at most ", kMaxRegionNameBytes, " are accepted"));
  }
  if (spec.dtype().size() > kMaxDtypeBytes) {
    return absl::InvalidArgumentError(absl::StrCat("region '", spec.name(), "' has a dtype of ",
                                                   spec.dtype().size(), " bytes; at most ",
                                                   kMaxDtypeBytes, " are accepted"));
  }
  if (spec.shape_size() > kMaxShapeDimensions) {
    return absl::InvalidArgumentError(absl::StrCat("region '", spec.name(), "' has ",
                                                   spec.shape_size(), " dimensions; at most ",
                                                   kMaxShapeDimensions, " are accepted"));
  }
  if (spec.bytes() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("region '", spec.name(), "' has 0 bytes"));
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon
