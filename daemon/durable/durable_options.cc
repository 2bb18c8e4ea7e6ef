// DurableOptions::Validate: the combinations a config may not set.
#include "daemon/durable/durable_options.h"

#include "absl/strings/str_cat.h"

namespace moesnap::daemon::durable {

absl::Status DurableOptions::Validate() const {
  if (directory.empty()) return absl::OkStatus();
  if (directory.front() != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("directory must be an absolute path, got '", directory, "'"));
  }
  if (every_steps == 0 && every_seconds == 0) {
    return absl::InvalidArgumentError(
        "a directory needs every_steps or every_seconds (or both) to say when to drain");
  }
  if (keep == 0) return absl::InvalidArgumentError("keep must be at least 1");
  return absl::OkStatus();
}

}  // namespace moesnap::daemon::durable
