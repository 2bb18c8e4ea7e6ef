// Agent and Admin request checks: what a real trainer and moesnapctl send passes; each hostile
// field is refused with INVALID_ARGUMENT and a message naming it.
#include "daemon/request_checks.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "absl/strings/match.h"
#include "daemon/region_limits.h"
#include "daemon/shard_layout.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

constexpr int64_t kLargestStep = std::numeric_limits<int64_t>::max();

void ExpectRefused(const absl::Status& status, const std::string& mentions) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), mentions))
      << "'" << status.message() << "' does not mention '" << mentions << "'";
}

v1::RegionSpec HostRegion(const std::string& name, uint64_t bytes = 4096) {
  v1::RegionSpec spec;
  spec.set_name(name);
  spec.set_device(v1::DEVICE_HOST);
  spec.set_bytes(bytes);
  spec.set_dtype("float32");
  spec.add_shape(static_cast<int64_t>(bytes / 4));
  spec.mutable_handle()->set_memory(1);
  spec.mutable_handle()->set_shm_offset(8192);
  return spec;
}

v1::RegionSpec GpuRegion(const std::string& name) {
  v1::RegionSpec spec = HostRegion(name);
  spec.set_device(v1::DEVICE_CUDA);
  spec.mutable_handle()->clear_memory();
  spec.mutable_handle()->clear_shm_offset();
  spec.mutable_handle()->set_cuda_memory_handle(std::string(kCudaIpcHandleBytes, 'm'));
  spec.mutable_handle()->set_cuda_event_handle(std::string(kCudaIpcHandleBytes, 'e'));
  spec.mutable_handle()->set_cuda_device(1);
  return spec;
}

v1::RegisterRegionsRequest Registration() {
  v1::RegisterRegionsRequest request;
  request.set_rank(3);
  *request.add_regions() = HostRegion("layer0.weight");
  *request.add_regions() = GpuRegion("layer0.expert1.weight");
  v1::RegionSpec replicated = HostRegion("embedding");
  replicated.mutable_replica_group()->set_name("dp");
  for (uint32_t rank : {1, 3, 5}) replicated.mutable_replica_group()->add_ranks(rank);
  *request.add_regions() = replicated;
  return request;
}

v1::SnapshotRequest SparseSnapshot() {
  v1::SnapshotRequest request;
  request.set_rank(0);
  request.set_step(6);
  request.add_regions("layer0.expert1.weight");
  v1::SparseSlot* slot = request.mutable_sparse();
  slot->set_window_first_step(4);
  slot->set_window_size(4);
  slot->set_slot(2);
  slot->set_buffer(1);
  slot->add_operators("layer0.expert1");
  return request;
}

TEST(RequestChecksTest, WhatARealTrainerAndOperatorSendPasses) {
  EXPECT_OK(CheckRegisterRegions(Registration()));
  EXPECT_OK(CheckSnapshot(SparseSnapshot()));
  v1::SnapshotRequest dense;
  dense.set_step(kMaxStep);
  EXPECT_OK(CheckSnapshot(dense));
  v1::WaitRequest wait;
  wait.set_step(0);
  EXPECT_OK(CheckWait(wait));
  v1::RestoreRequest restore;
  restore.add_regions("layer0.weight");
  EXPECT_OK(CheckRestore(restore));
  restore.set_source_rank(7);  // elastic: the source's latest committed step
  EXPECT_OK(CheckRestore(restore));
  restore.set_source_rank(restore.rank());  // its own rank: any step
  restore.set_step(4);
  EXPECT_OK(CheckRestore(restore));
  v1::AppendLogRequest append;
  append.mutable_record()->set_rank(1);
  append.mutable_record()->set_peer_rank(2);
  append.mutable_record()->set_step(9);
  append.mutable_record()->set_direction(v1::LOG_DIRECTION_BACKWARD);
  EXPECT_OK(CheckAppendLog(append));
  v1::FetchLogRequest fetch;
  fetch.set_rank(1);
  fetch.set_peer_rank(2);
  fetch.set_direction(v1::LOG_DIRECTION_FORWARD);
  EXPECT_OK(CheckFetchLog(fetch));
  EXPECT_OK(CheckInspectStep(v1::InspectStepRequest()));
  EXPECT_OK(CheckDropStep(v1::DropStepRequest()));
  EXPECT_OK(CheckVerify(v1::VerifyRequest()));
  v1::ExportRequest export_request;
  for (v1::Tier tier : {v1::TIER_UNSPECIFIED, v1::TIER_MEMORY, v1::TIER_DURABLE}) {
    export_request.set_tier(tier);
    EXPECT_OK(CheckExport(export_request));
  }
}

TEST(RequestChecksTest, StepsOutsideZeroToTheBoundAreRefusedEverywhere) {
  for (int64_t step : {int64_t{-1}, kMaxStep + 1, kLargestStep,
                       std::numeric_limits<int64_t>::min()}) {
    SCOPED_TRACE(step);
    v1::SnapshotRequest snapshot;
    snapshot.set_step(step);
    ExpectRefused(CheckSnapshot(snapshot), "steps are 0 to");
    v1::WaitRequest wait;
    wait.set_step(step);
    ExpectRefused(CheckWait(wait), "steps are 0 to");
    v1::RestoreRequest restore;
    restore.set_step(step);
    ExpectRefused(CheckRestore(restore), "steps are 0 to");
    v1::AppendLogRequest append;
    append.mutable_record()->set_peer_rank(1);
    append.mutable_record()->set_direction(v1::LOG_DIRECTION_FORWARD);
    append.mutable_record()->set_step(step);
    ExpectRefused(CheckAppendLog(append), "the record's step");
    v1::FetchLogRequest fetch;
    fetch.set_peer_rank(1);
    fetch.set_direction(v1::LOG_DIRECTION_FORWARD);
    fetch.set_step(step);
    ExpectRefused(CheckFetchLog(fetch), "steps are 0 to");
    v1::InspectStepRequest inspect;
    inspect.set_step(step);
    ExpectRefused(CheckInspectStep(inspect), "steps are 0 to");
    v1::DropStepRequest drop;
    drop.set_step(step);
    ExpectRefused(CheckDropStep(drop), "steps are 0 to");
    v1::VerifyRequest verify;
    verify.set_step(step);
    ExpectRefused(CheckVerify(verify), "steps are 0 to");
    v1::ExportRequest export_request;
    export_request.set_step(step);
    ExpectRefused(CheckExport(export_request), "steps are 0 to");
  }
}

TEST(RequestChecksTest, ARegistrationIsBoundedRegionByRegion) {
  {
    v1::RegisterRegionsRequest request = Registration();
    *request.add_regions() = HostRegion("layer0.weight");
    ExpectRefused(CheckRegisterRegions(request), "'layer0.weight' is registered twice");
  }
  {
    v1::RegisterRegionsRequest request = Registration();
    request.mutable_regions(0)->set_bytes(kMaxRegionBytes + 1);
    ExpectRefused(CheckRegisterRegions(request), "at most 70368744177664");
    request.mutable_regions(0)->set_bytes(0);
    ExpectRefused(CheckRegisterRegions(request), "0 bytes");
  }
  {
    v1::RegisterRegionsRequest request = Registration();
    request.mutable_regions(0)->set_name(std::string(kMaxRegionNameBytes + 1, 'n'));
    ExpectRefused(CheckRegisterRegions(request), "at most 1024");
  }
  {
    v1::RegisterRegionsRequest request = Registration();
    request.mutable_regions(1)->add_shape(-4);
    ExpectRefused(CheckRegisterRegions(request), "dimension 1 of -4");
  }
  {
    v1::RegisterRegionsRequest request = Registration();
    request.mutable_regions(0)->set_device(v1::DEVICE_UNSPECIFIED);
    ExpectRefused(CheckRegisterRegions(request), "device 0 is neither");
    request.mutable_regions(0)->set_device(static_cast<v1::Device>(9));
    ExpectRefused(CheckRegisterRegions(request), "device 9 is neither");
  }
  {
    v1::RegisterRegionsRequest request = Registration();
    request.mutable_regions(0)->mutable_handle()->set_cuda_memory_handle("x");
    ExpectRefused(CheckRegisterRegions(request), "host memory with CUDA IPC handles");
  }
  {
    v1::RegisterRegionsRequest request = Registration();
    request.mutable_regions(1)->mutable_handle()->set_cuda_memory_handle(std::string(63, 'm'));
    ExpectRefused(CheckRegisterRegions(request), "memory handle is 64 bytes, got 63");
  }
  {
    v1::RegisterRegionsRequest request = Registration();
    request.mutable_regions(1)->mutable_handle()->set_cuda_event_handle(std::string(65, 'e'));
    ExpectRefused(CheckRegisterRegions(request), "event handle is 64 bytes, got 65");
    request.mutable_regions(1)->mutable_handle()->clear_cuda_event_handle();  // no event: allowed
    EXPECT_OK(CheckRegisterRegions(request));
    request.mutable_regions(1)->mutable_handle()->set_cuda_device(-1);
    ExpectRefused(CheckRegisterRegions(request), "CUDA device -1");
  }
  {
    // A replica group must include the registering rank, and is checked as shard_layout.h says.
    v1::RegisterRegionsRequest request = Registration();
    request.set_rank(2);
    ExpectRefused(CheckRegisterRegions(request), "do not include rank 2");
    request.set_rank(3);
    request.mutable_regions(2)->mutable_replica_group()->add_ranks(1);
    ExpectRefused(CheckRegisterRegions(request), "lists rank 1 twice");
  }
  {
    v1::RegisterRegionsRequest request;
    for (int i = 0; i <= kMaxRegionsPerRegistration; ++i) {
      *request.add_regions() = HostRegion(std::to_string(i));
    }
    ExpectRefused(CheckRegisterRegions(request), "at most 65536 are accepted per call");
    request.mutable_regions()->RemoveLast();
    EXPECT_OK(CheckRegisterRegions(request));
  }
}

TEST(RequestChecksTest, ASparseSlotLiesInsideItsWindowWithoutOverflow) {
  {
    v1::SnapshotRequest request = SparseSnapshot();
    request.mutable_sparse()->set_slot(4);
    ExpectRefused(CheckSnapshot(request), "a window of 4 steps has no such slot");
    request.mutable_sparse()->set_window_size(0);
    request.mutable_sparse()->set_slot(0);
    ExpectRefused(CheckSnapshot(request), "a window of 0 steps has no such slot");
  }
  {
    v1::SnapshotRequest request = SparseSnapshot();
    request.set_step(7);
    ExpectRefused(CheckSnapshot(request), "slot 2 of that window is step 6");
  }
  {
    // window_first_step + slot would overflow int64: refused by the bound on steps first.
    v1::SnapshotRequest request = SparseSnapshot();
    request.mutable_sparse()->set_window_first_step(kLargestStep);
    request.mutable_sparse()->set_slot(3);
    ExpectRefused(CheckSnapshot(request), "the window's first step is 9223372036854775807");
    request.mutable_sparse()->set_window_first_step(-2);
    request.set_step(1);
    ExpectRefused(CheckSnapshot(request), "the window's first step is -2");
  }
  {
    // The last slot of a window that ends at the largest step.
    v1::SnapshotRequest request = SparseSnapshot();
    request.mutable_sparse()->set_window_first_step(kMaxStep - 3);
    request.mutable_sparse()->set_slot(3);
    request.set_step(kMaxStep);
    EXPECT_OK(CheckSnapshot(request));
  }
  {
    v1::SnapshotRequest request = SparseSnapshot();
    request.mutable_sparse()->set_buffer(2);
    ExpectRefused(CheckSnapshot(request), "buffer 2; a window writes buffer 0 or 1");
  }
  {
    v1::SnapshotRequest request = SparseSnapshot();
    request.mutable_sparse()->add_operators("");
    ExpectRefused(CheckSnapshot(request), "an operator name of 0 bytes");
    request.mutable_sparse()->set_operators(1, std::string(kMaxRegionNameBytes + 1, 'o'));
    ExpectRefused(CheckSnapshot(request), "an operator name of 1025 bytes");
  }
  {
    v1::SnapshotRequest request = SparseSnapshot();
    for (int i = 0; i < kMaxOperatorsPerSlot; ++i) request.mutable_sparse()->add_operators("o");
    ExpectRefused(CheckSnapshot(request), "65537 operators; at most 65536");
  }
}

TEST(RequestChecksTest, NamesASnapshotOrRestoreSelectsAreBounded) {
  v1::SnapshotRequest snapshot;
  snapshot.add_regions("");
  ExpectRefused(CheckSnapshot(snapshot), "a name of 0 bytes");
  v1::RestoreRequest restore;
  restore.add_regions(std::string(5000, 'r'));
  ExpectRefused(CheckRestore(restore), "a name of 5000 bytes ('rrrr");
  restore.clear_regions();
  for (int i = 0; i <= kMaxNamesPerRequest; ++i) restore.add_regions("r");
  ExpectRefused(CheckRestore(restore), "1048577 names; at most 1048576");
}

TEST(RequestChecksTest, ARestoreFromAnotherRankTakesNoStep) {
  v1::RestoreRequest request;
  request.set_rank(1);
  request.set_source_rank(2);
  request.set_step(5);
  ExpectRefused(CheckRestore(request), "leave step out");
}

TEST(RequestChecksTest, LogRecordsAndFetchesNeedADirectionAndAnotherRank) {
  v1::AppendLogRequest append;
  append.mutable_record()->set_rank(1);
  append.mutable_record()->set_peer_rank(2);
  ExpectRefused(CheckAppendLog(append), "direction 0, not LOG_DIRECTION_FORWARD");
  append.mutable_record()->set_direction(static_cast<v1::LogDirection>(3));
  ExpectRefused(CheckAppendLog(append), "direction 3");
  append.mutable_record()->set_direction(v1::LOG_DIRECTION_FORWARD);
  append.mutable_record()->set_peer_rank(1);
  ExpectRefused(CheckAppendLog(append), "a rank does not send to itself");
  v1::FetchLogRequest fetch;
  fetch.set_rank(4);
  fetch.set_peer_rank(5);
  fetch.set_direction(static_cast<v1::LogDirection>(-1));
  ExpectRefused(CheckFetchLog(fetch), "direction -1");
  fetch.set_direction(v1::LOG_DIRECTION_BACKWARD);
  fetch.set_peer_rank(4);
  ExpectRefused(CheckFetchLog(fetch), "a rank does not send to itself");
}

TEST(RequestChecksTest, AnExportNamesATierThatExists) {
  v1::ExportRequest request;
  request.set_tier(static_cast<v1::Tier>(3));
  ExpectRefused(CheckExport(request), "tier 3 is none of");
}

}  // namespace
}  // namespace moesnap::daemon
