// The few entry points of the CUDA driver API that GPU regions use, loaded from libcuda.so.1 when
// the first GPU region is registered: libmoesnap links no CUDA library, so it loads (and the
// Python package imports) on machines without CUDA. The driver API, unlike the runtime, has one
// stable ABI across CUDA releases, so whatever CUDA runtime the trainer's framework brings, its
// memory and streams are the driver's own and can be shared from here. The types below are the
// driver's (cuda.h), declared here so that no CUDA header is needed to build.
#ifndef MOESNAP_CLIENT_SRC_CUDA_DRIVER_H_
#define MOESNAP_CLIENT_SRC_CUDA_DRIVER_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace moesnap {

using CuResult = int;  // CUresult; 0 is CUDA_SUCCESS
using CuDevice = int;
using CuContext = struct CuContextOpaque*;
using CuStream = struct CuStreamOpaque*;
using CuEvent = struct CuEventOpaque*;
using CuDevicePointer = unsigned long long;  // CUdeviceptr
constexpr size_t kCudaIpcHandleBytes = 64;   // CU_IPC_HANDLE_SIZE
struct CuIpcMemHandle {
  char reserved[kCudaIpcHandleBytes];
};
struct CuIpcEventHandle {
  char reserved[kCudaIpcHandleBytes];
};
constexpr unsigned kCuEventDisableTiming = 0x2;  // CU_EVENT_DISABLE_TIMING
constexpr unsigned kCuEventInterprocess = 0x4;   // CU_EVENT_INTERPROCESS

// Function pointers into the driver, named as cuda.h's macros name them (the _v2 symbols).
struct CudaDriver {
  CuResult (*device_get)(CuDevice* device, int ordinal);
  CuResult (*primary_context_retain)(CuContext* context, CuDevice device);
  CuResult (*primary_context_release)(CuDevice device);
  CuResult (*context_push)(CuContext context);
  CuResult (*context_pop)(CuContext* context);
  CuResult (*memory_address_range)(CuDevicePointer* base, size_t* bytes, CuDevicePointer pointer);
  CuResult (*ipc_get_memory_handle)(CuIpcMemHandle* handle, CuDevicePointer pointer);
  CuResult (*event_create)(CuEvent* event, unsigned flags);
  CuResult (*ipc_get_event_handle)(CuIpcEventHandle* handle, CuEvent event);
  CuResult (*event_record)(CuEvent event, CuStream stream);
  CuResult (*event_destroy)(CuEvent event);
  CuResult (*get_error_name)(CuResult error, const char** name);

  // "cuIpcGetMemHandle: CUDA_ERROR_INVALID_VALUE (1)".
  std::string Describe(const char* call, CuResult error) const;
};

// Loads libcuda.so.1 and initializes the driver, once per process (later calls return the first
// outcome). FAILED_PRECONDITION, with the loader's reason, when there is no driver.
absl::StatusOr<const CudaDriver*> LoadCudaDriver();

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SRC_CUDA_DRIVER_H_
