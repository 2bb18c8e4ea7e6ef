// GPU regions end to end: a real moesnapd captures device memory shared by CUDA IPC into its pinned
// pool and restores it, byte for byte. Skips, saying why, on a machine without a usable GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

#include "moesnap/client.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

TEST(CudaCaptureTest, DeviceRegionRoundTripsThroughTheDaemon) {
  int devices = 0;
  if (cudaError_t error = cudaGetDeviceCount(&devices); error != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no usable CUDA device: " << cudaGetErrorString(error);
  }
  // The pool pinned with cudaHostRegister, as in production.
  testing::TestDaemon daemon({.pool_bytes = "1GiB", .pool_lock = "required"});
  ASSERT_TRUE(daemon.Start());
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.socket_path = daemon.agent_socket(), .rank = 0});
  ASSERT_OK(client);

  constexpr size_t kBytes = 64 << 20;
  void* allocation = nullptr;
  ASSERT_EQ(cudaMalloc(&allocation, 2 * kBytes), cudaSuccess);
  std::vector<uint8_t> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<uint8_t>(i * 131 + (i >> 20));
  // The region sits at an offset inside the allocation, as tensors in PyTorch's caching allocator do.
  uint8_t* region = static_cast<uint8_t*>(allocation) + kBytes;
  ASSERT_EQ(cudaMemcpy(region, pattern.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_OK((*client)->RegisterDeviceRegion({"layer0.expert0.master", "uint8", {}},
                                            {0, region, kBytes, nullptr}));
  ASSERT_OK((*client)->Snapshot(1));
  ASSERT_OK((*client)->WaitCommitted(1));

  ASSERT_EQ(cudaMemset(region, 0, kBytes), cudaSuccess);
  absl::StatusOr<RestoreResult> restored = (*client)->Restore();
  ASSERT_OK(restored);
  EXPECT_EQ(restored->step, 1);
  std::vector<uint8_t> back(kBytes);
  ASSERT_EQ(cudaMemcpy(back.data(), region, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, pattern);
  cudaFree(allocation);
}

}  // namespace
}  // namespace moesnap
