// Built instead of gpu_suite.cc when the build has no CUDA toolkit.
#include "bench/suites.h"

namespace moesnap::bench {

absl::Status RunGpuSuite(Report&) {
  return absl::UnavailableError("moesnap-bench was built without CUDA");
}

}  // namespace moesnap::bench
