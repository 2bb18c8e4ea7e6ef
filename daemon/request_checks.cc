// Agent and Admin request checks: each field against its bound, overflow-safe; names too long to
// print are cut in messages.
#include "daemon/request_checks.h"

#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "daemon/region_limits.h"
#include "daemon/shard_layout.h"

namespace moesnap::daemon {
namespace {

// At most this much of a name a caller sent goes into a message.
constexpr size_t kNameShown = 64;

std::string Shown(absl::string_view name) {
  return name.size() <= kNameShown ? std::string(name)
                                   : absl::StrCat(name.substr(0, kNameShown), "...");
}

absl::Status CheckStep(absl::string_view field, int64_t step) {
  if (step < 0 || step > kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", step, "; steps are 0 to ", kMaxStep));
  }
  return absl::OkStatus();
}

// Names a request selects: at most `most` of them, each 1 to kMaxRegionNameBytes long.
absl::Status CheckNames(absl::string_view field,
                        const google::protobuf::RepeatedPtrField<std::string>& names, int most) {
  if (names.size() > most) {
    return absl::InvalidArgumentError(absl::StrCat(field, " lists ", names.size(),
                                                   " names; at most ", most, " are accepted"));
  }
  for (const std::string& name : names) {
    if (name.empty() || name.size() > kMaxRegionNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, " lists a name of ", name.size(),
                                                     " bytes ('", Shown(name), "'); names are 1 to ",
                                                     kMaxRegionNameBytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckHandle(const v1::RegionSpec& spec) {
  const v1::RegionHandle& handle = spec.handle();
  auto invalid = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("region '", spec.name(), "': ", what));
  };
  switch (spec.device()) {
    case v1::DEVICE_HOST:
      if (!handle.cuda_memory_handle().empty() || !handle.cuda_event_handle().empty()) {
        return invalid("host memory with CUDA IPC handles");
      }
      return absl::OkStatus();
    case v1::DEVICE_CUDA:
      if (handle.cuda_memory_handle().size() != kCudaIpcHandleBytes) {
        return invalid(absl::StrCat("a CUDA IPC memory handle is ", kCudaIpcHandleBytes,
                                    " bytes, got ", handle.cuda_memory_handle().size()));
      }
      if (!handle.cuda_event_handle().empty() &&
          handle.cuda_event_handle().size() != kCudaIpcHandleBytes) {
        return invalid(absl::StrCat("a CUDA IPC event handle is ", kCudaIpcHandleBytes,
                                    " bytes, got ", handle.cuda_event_handle().size()));
      }
      if (handle.cuda_device() < 0) {
        return invalid(absl::StrCat("CUDA device ", handle.cuda_device(), " is negative"));
      }
      return absl::OkStatus();
    default:
      return invalid(absl::StrCat("device ", static_cast<int>(spec.device()),
                                  " is neither DEVICE_HOST nor DEVICE_CUDA"));
  }
}

absl::Status CheckSparseSlot(int64_t step, const v1::SparseSlot& sparse) {
  const auto where = [&] {
    return absl::StrCat("step ", step, " as slot ", sparse.slot(), " of the window from step ",
                        sparse.window_first_step());
  };
  if (absl::Status status = CheckStep("the window's first step", sparse.window_first_step());
      !status.ok()) {
    return status;
  }
  if (sparse.window_size() == 0 || sparse.slot() >= sparse.window_size()) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": a window of ", sparse.window_size(),
                                                   " steps has no such slot"));
  }
  // Both bounded: the sum cannot overflow.
  const int64_t slot_step = sparse.window_first_step() + int64_t{sparse.slot()};
  if (slot_step != step) {
    return absl::InvalidArgumentError(
        absl::StrCat(where(), ": slot ", sparse.slot(), " of that window is step ", slot_step));
  }
  if (sparse.buffer() >= kSparseBuffers) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": buffer ", sparse.buffer(),
                                                   "; a window writes buffer 0 or 1"));
  }
  if (sparse.operators_size() > kMaxOperatorsPerSlot) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": ", sparse.operators_size(),
                                                   " operators; at most ", kMaxOperatorsPerSlot,
                                                   " are accepted"));
  }
  for (const std::string& name : sparse.operators()) {
    if (name.empty() || name.size() > kMaxRegionNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": an operator name of ", name.size(),
                                                     " bytes ('", Shown(name), "'); names are 1 to ",
                                                     kMaxRegionNameBytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDirection(absl::string_view what, v1::LogDirection direction, uint32_t rank,
                            uint32_t peer_rank) {
  if (direction != v1::LOG_DIRECTION_FORWARD && direction != v1::LOG_DIRECTION_BACKWARD) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has direction ", static_cast<int>(direction),
                     ", not LOG_DIRECTION_FORWARD or LOG_DIRECTION_BACKWARD"));
  }
  if (rank == peer_rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is from rank ", rank, " to itself: a rank does not send to itself"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckRegisterRegions(const v1::RegisterRegionsRequest& request) {
  if (request.regions_size() > kMaxRegionsPerRegistration) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a registration of ", request.regions_size(), " regions; at most ",
        kMaxRegionsPerRegistration, " are accepted per call"));
  }
  std::set<absl::string_view> names;
  for (const v1::RegionSpec& spec : request.regions()) {
    if (absl::Status valid = CheckRegionSpec(spec); !valid.ok()) return valid;
    if (!names.insert(spec.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("region '", spec.name(), "' is registered twice in one call"));
    }
    if (spec.bytes() > kMaxRegionBytes) {
      return absl::InvalidArgumentError(absl::StrCat("region '", spec.name(), "' is ", spec.bytes(),
                                                     " bytes; at most ", kMaxRegionBytes,
                                                     " are accepted"));
    }
    for (int dimension = 0; dimension < spec.shape_size(); ++dimension) {
      if (spec.shape(dimension) < 0) {
        return absl::InvalidArgumentError(absl::StrCat("region '", spec.name(), "' has dimension ",
                                                       dimension, " of ", spec.shape(dimension)));
      }
    }
    if (absl::Status valid = CheckHandle(spec); !valid.ok()) return valid;
    if (spec.has_replica_group()) {
      if (absl::Status valid = CheckReplicaGroup(request.rank(), spec.name(), spec.replica_group());
          !valid.ok()) {
        return valid;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSnapshot(const v1::SnapshotRequest& request) {
  if (absl::Status status = CheckStep("step", request.step()); !status.ok()) return status;
  if (absl::Status status = CheckNames("the snapshot", request.regions(), kMaxNamesPerRequest);
      !status.ok()) {
    return status;
  }
  if (request.has_sparse()) return CheckSparseSlot(request.step(), request.sparse());
  return absl::OkStatus();
}

absl::Status CheckWait(const v1::WaitRequest& request) {
  return CheckStep("step", request.step());
}

absl::Status CheckRestore(const v1::RestoreRequest& request) {
  if (request.has_step()) {
    if (absl::Status status = CheckStep("step", request.step()); !status.ok()) return status;
  }
  if (absl::Status status = CheckNames("the restore", request.regions(), kMaxNamesPerRequest);
      !status.ok()) {
    return status;
  }
  if (request.has_source_rank() && request.source_rank() != request.rank() && request.has_step()) {
    return absl::InvalidArgumentError(
        "a restore from another rank takes its latest committed step: leave step out");
  }
  return absl::OkStatus();
}

absl::Status CheckAppendLog(const v1::AppendLogRequest& request) {
  const v1::LogRecord& record = request.record();
  if (absl::Status status = CheckStep("the record's step", record.step()); !status.ok()) {
    return status;
  }
  return CheckDirection(absl::StrCat("record ", record.micro_batch(), " of step ", record.step()),
                        record.direction(), record.rank(), record.peer_rank());
}

absl::Status CheckFetchLog(const v1::FetchLogRequest& request) {
  if (absl::Status status = CheckStep("step", request.step()); !status.ok()) return status;
  return CheckDirection(absl::StrCat("the log of step ", request.step()), request.direction(),
                        request.rank(), request.peer_rank());
}

absl::Status CheckInspectStep(const v1::InspectStepRequest& request) {
  return CheckStep("step", request.step());
}

absl::Status CheckDropStep(const v1::DropStepRequest& request) {
  return CheckStep("step", request.step());
}

absl::Status CheckVerify(const v1::VerifyRequest& request) {
  return request.has_step() ? CheckStep("step", request.step()) : absl::OkStatus();
}

absl::Status CheckExport(const v1::ExportRequest& request) {
  if (request.has_step()) {
    if (absl::Status status = CheckStep("step", request.step()); !status.ok()) return status;
  }
  if (request.tier() != v1::TIER_UNSPECIFIED && request.tier() != v1::TIER_MEMORY &&
      request.tier() != v1::TIER_DURABLE) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tier ", static_cast<int>(request.tier()),
        " is none of TIER_UNSPECIFIED (memory, else disk), TIER_MEMORY and TIER_DURABLE"));
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon
