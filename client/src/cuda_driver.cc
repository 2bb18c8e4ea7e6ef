// dlopen of the CUDA driver, once per process.
#include "client/src/cuda_driver.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace moesnap {
namespace {

constexpr const char* kDriverLibrary = "libcuda.so.1";

template <typename Function>
absl::Status Resolve(void* library, const char* symbol, Function*& function) {
  function = reinterpret_cast<Function*>(dlsym(library, symbol));
  if (function == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(kDriverLibrary, " has no ", symbol, " (a CUDA driver older than 11.0?)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaDriver> Load() {
  // RTLD_LOCAL: the driver's symbols stay out of the process's global scope, as when the
  // framework's CUDA runtime loads it.
  void* library = dlopen(kDriverLibrary, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* reason = dlerror();
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot load the CUDA driver: ", reason != nullptr ? reason : kDriverLibrary));
  }
  CudaDriver driver{};
  CuResult (*init)(unsigned flags) = nullptr;
  for (absl::Status status : {
           Resolve(library, "cuInit", init),
           Resolve(library, "cuDeviceGet", driver.device_get),
           Resolve(library, "cuDevicePrimaryCtxRetain", driver.primary_context_retain),
           Resolve(library, "cuDevicePrimaryCtxRelease_v2", driver.primary_context_release),
           Resolve(library, "cuCtxPushCurrent_v2", driver.context_push),
           Resolve(library, "cuCtxPopCurrent_v2", driver.context_pop),
           Resolve(library, "cuMemGetAddressRange_v2", driver.memory_address_range),
           Resolve(library, "cuIpcGetMemHandle", driver.ipc_get_memory_handle),
           Resolve(library, "cuEventCreate", driver.event_create),
           Resolve(library, "cuIpcGetEventHandle", driver.ipc_get_event_handle),
           Resolve(library, "cuEventRecord", driver.event_record),
           Resolve(library, "cuEventDestroy_v2", driver.event_destroy),
           Resolve(library, "cuGetErrorName", driver.get_error_name),
       }) {
    if (!status.ok()) return status;  // the library stays loaded: a process loads it once
  }
  if (CuResult error = init(0); error != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("the CUDA driver did not initialize: ", driver.Describe("cuInit", error)));
  }
  return driver;
}

}  // namespace

std::string CudaDriver::Describe(const char* call, CuResult error) const {
  const char* name = nullptr;
  if (get_error_name == nullptr || get_error_name(error, &name) != 0 || name == nullptr) {
    name = "an unknown CUDA error";
  }
  return absl::StrCat(call, ": ", name, " (", error, ")");
}

absl::StatusOr<const CudaDriver*> LoadCudaDriver() {
  static const absl::StatusOr<CudaDriver>* const loaded = new absl::StatusOr<CudaDriver>(Load());
  if (!loaded->ok()) return loaded->status();
  return &loaded->value();
}

}  // namespace moesnap
