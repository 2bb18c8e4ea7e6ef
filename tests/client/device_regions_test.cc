// GPU regions against a fake CUDA driver: the driver is loaded at the first shared region and not
// before, every call runs in the device's primary context and leaves the caller's as it was, IPC
// handles and events reach the daemon's handle, regions of one stream share one event recorded once
// per snapshot, and driver errors name the call. The real loader is checked where this machine has no driver.
#include "client/src/device_regions.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "tests/testing/status_matchers.h"

namespace moesnap {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// What the fake driver saw; the driver's entry points are plain functions, so they reach it
// through this pointer, set by each test.
struct FakeDriverState {
  int loads = 0;
  int context_depth = 0;  // pushed minus popped
  int deepest_context = 0;
  std::vector<CuDevicePointer> exported_memory;
  std::vector<unsigned> event_flags;
  std::vector<std::pair<CuEvent, CuStream>> recorded;
  std::vector<CuEvent> destroyed;
  std::vector<CuDevice> released;
  uintptr_t next_event = 0x1000;
  CuResult memory_handle_result = 0;
  // Device memory as allocations of allocation_bytes starting at multiples of 0x1000.
  CuResult address_range_result = 0;
  size_t allocation_bytes = 0x2000;
};
FakeDriverState* fake = nullptr;

const CudaDriver kFakeDriver = {
    .device_get = [](CuDevice* device, int ordinal) -> CuResult {
      *device = 100 + ordinal;
      return 0;
    },
    .primary_context_retain = [](CuContext* context, CuDevice device) -> CuResult {
      *context = reinterpret_cast<CuContext>(static_cast<uintptr_t>(device));
      return 0;
    },
    .primary_context_release = [](CuDevice device) -> CuResult {
      fake->released.push_back(device);
      return 0;
    },
    .context_push = [](CuContext) -> CuResult {
      fake->deepest_context = std::max(fake->deepest_context, ++fake->context_depth);
      return 0;
    },
    .context_pop = [](CuContext*) -> CuResult {
      --fake->context_depth;
      return 0;
    },
    .memory_address_range = [](CuDevicePointer* base, size_t* bytes,
                               CuDevicePointer pointer) -> CuResult {
      if (fake->address_range_result != 0) return fake->address_range_result;
      *base = pointer & ~CuDevicePointer{0xFFF};
      *bytes = fake->allocation_bytes;
      return 0;
    },
    .ipc_get_memory_handle = [](CuIpcMemHandle* handle, CuDevicePointer pointer) -> CuResult {
      if (fake->memory_handle_result != 0) return fake->memory_handle_result;
      fake->exported_memory.push_back(pointer);
      std::memset(handle->reserved, 0xAB, sizeof(handle->reserved));
      return 0;
    },
    .event_create = [](CuEvent* event, unsigned flags) -> CuResult {
      fake->event_flags.push_back(flags);
      *event = reinterpret_cast<CuEvent>(fake->next_event++);
      return 0;
    },
    .ipc_get_event_handle = [](CuIpcEventHandle* handle, CuEvent) -> CuResult {
      std::memset(handle->reserved, 0xCD, sizeof(handle->reserved));
      return 0;
    },
    .event_record = [](CuEvent event, CuStream stream) -> CuResult {
      fake->recorded.emplace_back(event, stream);
      return 0;
    },
    .event_destroy = [](CuEvent event) -> CuResult {
      fake->destroyed.push_back(event);
      return 0;
    },
    .get_error_name = [](CuResult error, const char** name) -> CuResult {
      *name = error == 1 ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_UNKNOWN";
      return 0;
    },
};

class DeviceRegionsTest : public ::testing::Test {
 protected:
  void SetUp() override { fake = &state_; }
  void TearDown() override { fake = nullptr; }

  DeviceRegions::DriverLoader FakeLoader() {
    return [this]() -> absl::StatusOr<const CudaDriver*> {
      ++state_.loads;
      return &kFakeDriver;
    };
  }

  // Shares the regions and ends the share as the client does once the daemon took them.
  static absl::StatusOr<std::vector<v1::RegionHandle>> Register(
      DeviceRegions& regions, const std::vector<std::pair<std::string, DeviceMemory>>& shared) {
    absl::StatusOr<std::vector<v1::RegionHandle>> handles = regions.Share(shared);
    if (handles.ok()) regions.EndShare(shared, /*registered=*/true);
    return handles;
  }

  // 4 KiB at `offset` of the allocation at `base`.
  static DeviceMemory Memory(uintptr_t base, size_t offset, uintptr_t stream) {
    return {.device = 1, .address = reinterpret_cast<void*>(base + offset), .bytes = 4096,
            .stream = reinterpret_cast<void*>(stream)};
  }

  FakeDriverState state_;
};

TEST_F(DeviceRegionsTest, LoadsTheDriverAtTheFirstSharedRegionAndNotBefore) {
  DeviceRegions regions(FakeLoader());
  ASSERT_OK(regions.RecordCaptureEvents({}));  // a trainer with host regions only
  ASSERT_OK(regions.RecordCaptureEvents({"model.weight"}));
  ASSERT_OK(regions.Share({}));
  EXPECT_EQ(state_.loads, 0);
  ASSERT_OK(Register(regions, {{"a", Memory(0x7000, 0, 0)}}));
  ASSERT_OK(Register(regions, {{"b", Memory(0x9000, 0, 0)}}));
  EXPECT_EQ(state_.loads, 1);
}

TEST_F(DeviceRegionsTest, WithoutADriverSharingFailsNamingTheRegionAndTheReason) {
  DeviceRegions regions([]() -> absl::StatusOr<const CudaDriver*> {
    return absl::FailedPreconditionError(
        "cannot load the CUDA driver: libcuda.so.1: cannot open shared object file");
  });
  absl::StatusOr<std::vector<v1::RegionHandle>> handles =
      regions.Share({{"layer0.weight", Memory(0x7000, 0, 0)}});
  ASSERT_STATUS(handles, absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(handles.status().message(), HasSubstr("GPU region 'layer0.weight'"));
  EXPECT_THAT(handles.status().message(), HasSubstr("libcuda.so.1"));
}

TEST_F(DeviceRegionsTest, SharesTheWholeAllocationHoldingTheRegionAndAnInterprocessEvent) {
  DeviceRegions regions(FakeLoader());
  absl::StatusOr<std::vector<v1::RegionHandle>> handles =
      Register(regions, {{"a", Memory(0x7000, 512, 0)}});
  ASSERT_OK(handles);
  ASSERT_EQ(handles->size(), 1u);
  const v1::RegionHandle& handle = handles->front();
  EXPECT_THAT(state_.exported_memory, ElementsAre(0x7000));
  EXPECT_THAT(state_.event_flags, ElementsAre(kCuEventDisableTiming | kCuEventInterprocess));
  EXPECT_EQ(handle.cuda_memory_handle(), std::string(kCudaIpcHandleBytes, '\xAB'));
  EXPECT_EQ(handle.cuda_event_handle(), std::string(kCudaIpcHandleBytes, '\xCD'));
  EXPECT_EQ(handle.cuda_offset(), 512u);
  EXPECT_EQ(handle.cuda_device(), 1);
  EXPECT_EQ(state_.deepest_context, 1);
  EXPECT_EQ(state_.context_depth, 0);  // the trainer's context is current again
}

TEST_F(DeviceRegionsTest, RegionsOfOneStreamShareOneEventRecordedOncePerSnapshotAndOneExport) {
  DeviceRegions regions(FakeLoader());
  // Thousands of tensors written by one optimizer stream: one event, not one per tensor.
  std::vector<std::pair<std::string, DeviceMemory>> shared;
  for (int i = 0; i < 1000; ++i) shared.emplace_back("t" + std::to_string(i), Memory(0x7000, i, 0x51));
  shared.emplace_back("other.stream", Memory(0x9000, 0, 0x52));
  absl::StatusOr<std::vector<v1::RegionHandle>> handles = Register(regions, shared);
  ASSERT_OK(handles);
  ASSERT_EQ(handles->size(), shared.size());
  EXPECT_EQ(state_.event_flags.size(), 2u);
  EXPECT_THAT(state_.exported_memory, ElementsAre(0x7000, 0x9000));  // each allocation once
  EXPECT_EQ((*handles)[999].cuda_offset(), 999u);
  EXPECT_EQ((*handles)[999].cuda_memory_handle(), (*handles)[0].cuda_memory_handle());
  const CuEvent first = reinterpret_cast<CuEvent>(0x1000), second = reinterpret_cast<CuEvent>(0x1001);
  ASSERT_OK(regions.RecordCaptureEvents({}));
  EXPECT_THAT(state_.recorded,
              ElementsAre(std::make_pair(first, reinterpret_cast<CuStream>(0x51)),
                          std::make_pair(second, reinterpret_cast<CuStream>(0x52))));
  state_.recorded.clear();
  ASSERT_OK(regions.RecordCaptureEvents({"t1", "t2", "t3"}));
  EXPECT_THAT(state_.recorded, ElementsAre(std::make_pair(first, reinterpret_cast<CuStream>(0x51))));
}

TEST_F(DeviceRegionsTest, RecordsEventsOnTheStreamsOfTheNamedGpuRegionsOnly) {
  DeviceRegions regions(FakeLoader());
  ASSERT_OK(Register(regions, {{"a", Memory(0x7000, 0, 0x51)}, {"b", Memory(0x9000, 0, 0x52)}}));
  const CuEvent a = reinterpret_cast<CuEvent>(0x1000), b = reinterpret_cast<CuEvent>(0x1001);
  ASSERT_OK(regions.RecordCaptureEvents({"a", "host.region"}));
  EXPECT_THAT(state_.recorded, ElementsAre(std::make_pair(a, reinterpret_cast<CuStream>(0x51))));
  state_.recorded.clear();
  ASSERT_OK(regions.RecordCaptureEvents({}));
  EXPECT_THAT(state_.recorded, ElementsAre(std::make_pair(a, reinterpret_cast<CuStream>(0x51)),
                                           std::make_pair(b, reinterpret_cast<CuStream>(0x52))));
  EXPECT_EQ(state_.context_depth, 0);
}

TEST_F(DeviceRegionsTest, ARegionSharedAgainMovesToItsNewStreamAndTheLastRegionReleasesAnEvent) {
  {
    DeviceRegions regions(FakeLoader());
    ASSERT_OK(Register(regions, {{"a", Memory(0x7000, 0, 0x51)}, {"b", Memory(0x7000, 64, 0x51)}}));
    ASSERT_OK(Register(regions, {{"a", Memory(0x8000, 0, 0x52)}}));  // b still uses 0x51's event
    EXPECT_TRUE(state_.destroyed.empty());
    ASSERT_OK(Register(regions, {{"b", Memory(0x8000, 64, 0x52)}}));  // now nothing does
    EXPECT_THAT(state_.destroyed, ElementsAre(reinterpret_cast<CuEvent>(0x1000)));
    state_.recorded.clear();
    ASSERT_OK(regions.RecordCaptureEvents({}));
    EXPECT_THAT(state_.recorded, ElementsAre(std::make_pair(reinterpret_cast<CuEvent>(0x1001),
                                                            reinterpret_cast<CuStream>(0x52))));
    ASSERT_OK(Register(regions, {{"b", Memory(0x8000, 64, 0x52)}}));  // the same stream again
    EXPECT_EQ(state_.event_flags.size(), 2u);
  }
  EXPECT_THAT(state_.destroyed, ElementsAre(reinterpret_cast<CuEvent>(0x1000),
                                            reinterpret_cast<CuEvent>(0x1001)));
  EXPECT_THAT(state_.released, ElementsAre(101));  // device 1's primary context, once
}

TEST_F(DeviceRegionsTest, RefusesARegionRunningPastItsAllocationOrOutsideDeviceMemory) {
  DeviceRegions regions(FakeLoader());
  state_.allocation_bytes = 4096;
  absl::StatusOr<std::vector<v1::RegionHandle>> past = regions.Share({{"a", Memory(0x7000, 2048, 0)}});
  ASSERT_STATUS(past, absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(past.status().message(),
              HasSubstr("'a' is 4096 bytes at offset 2048 of a CUDA allocation of 4096 bytes"));
  state_.address_range_result = 1;
  absl::StatusOr<std::vector<v1::RegionHandle>> host = regions.Share({{"b", Memory(0x7000, 0, 0)}});
  ASSERT_STATUS(host, absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(host.status().message(), HasSubstr("0x7000 on device 1 is not device memory"));
  EXPECT_THAT(host.status().message(), HasSubstr("cuMemGetAddressRange: CUDA_ERROR_INVALID_VALUE"));
  EXPECT_TRUE(state_.exported_memory.empty());
  EXPECT_EQ(state_.context_depth, 0);
}

TEST_F(DeviceRegionsTest, ARegistrationTheDaemonRefusedLeavesEveryRegionWithTheEventItHad) {
  DeviceRegions regions(FakeLoader());
  ASSERT_OK(Register(regions, {{"a", Memory(0x7000, 0, 0x51)}}));
  const std::vector<std::pair<std::string, DeviceMemory>> moved = {{"a", Memory(0x7000, 0, 0x52)},
                                                                   {"b", Memory(0x7000, 64, 0x52)}};
  ASSERT_OK(regions.Share(moved));
  regions.EndShare(moved, /*registered=*/false);
  // The event made for the refused share is gone; a still waits on its stream's.
  EXPECT_THAT(state_.destroyed, ElementsAre(reinterpret_cast<CuEvent>(0x1001)));
  ASSERT_OK(regions.RecordCaptureEvents({"a", "b"}));
  EXPECT_THAT(state_.recorded, ElementsAre(std::make_pair(reinterpret_cast<CuEvent>(0x1000),
                                                          reinterpret_cast<CuStream>(0x51))));
  // A share that fails part-way holds nothing either.
  state_.allocation_bytes = 4096;
  ASSERT_STATUS(regions.Share({{"c", Memory(0x7000, 0, 0x53)}, {"d", Memory(0x7000, 2048, 0x53)}}),
                absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(state_.destroyed, ElementsAre(reinterpret_cast<CuEvent>(0x1001),
                                            reinterpret_cast<CuEvent>(0x1002)));
}

TEST_F(DeviceRegionsTest, DriverErrorsNameTheCallAndTheError) {
  DeviceRegions regions(FakeLoader());
  state_.memory_handle_result = 1;
  absl::StatusOr<std::vector<v1::RegionHandle>> handles =
      regions.Share({{"a", Memory(0x7000, 0, 0)}});
  ASSERT_STATUS(handles, absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(handles.status().message(), HasSubstr("cuIpcGetMemHandle: CUDA_ERROR_INVALID_VALUE"));
  EXPECT_EQ(state_.context_depth, 0);
}

TEST_F(DeviceRegionsTest, RefusesARegionWithoutAllocationOrSize) {
  DeviceRegions regions(FakeLoader());
  ASSERT_STATUS(regions.Share({{"ok", Memory(0x7000, 0, 0)}, {"a", Memory(0, 0, 0)}}),
                absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state_.loads, 0);  // checked before anything is shared
}

TEST(CudaDriverTest, LoadingWithoutADriverSaysWhy) {
  absl::StatusOr<const CudaDriver*> driver = LoadCudaDriver();
  if (driver.ok()) GTEST_SKIP() << "this machine has a CUDA driver";
  ASSERT_STATUS(driver, absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(driver.status().message(), HasSubstr("CUDA driver"));
}

}  // namespace
}  // namespace moesnap
