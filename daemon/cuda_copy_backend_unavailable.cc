// Built instead of cuda_copy_backend.cc when the build has no CUDA toolkit.
#include "daemon/copy_backend.h"

namespace moesnap::daemon {

absl::StatusOr<std::unique_ptr<CopyBackend>> CreateCudaCopyBackend() {
  return absl::UnavailableError("this moesnapd was built without CUDA (MOESNAP_CUDA=OFF or no "
                                "toolkit found): GPU regions are not supported");
}

}  // namespace moesnap::daemon
