// Fuzzes the checks of Agent (trainer) and Admin (moesnapctl) requests (daemon/request_checks.h)
// with protobuf-parsed input: the first byte picks the request type, the rest is its wire encoding.
// What a check accepts must hold every bound the daemon relies on, checked here again from the
// fields, and is then used the way the daemon uses it: a registration's replica groups are cut into
// shards that must cover each region exactly, a sparse slot's step arithmetic must not overflow,
// and an accepted log record must go into a real upstream log, come back whole from a fetch the
// fetch check accepts, and be dropped once the recovery point passes its step.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "daemon/region_limits.h"
#include "daemon/request_checks.h"
#include "daemon/shard_layout.h"
#include "daemon/upstream_log.h"
#include "proto/moesnap.pb.h"
#include "tests/fuzz/proto_input.h"

namespace {

using namespace moesnap::daemon;
using moesnap::fuzz::Parse;
namespace v1 = moesnap::v1;

void Require(bool condition) {
  if (!condition) std::abort();
}

bool StepInBounds(int64_t step) { return step >= 0 && step <= kMaxStep; }

void RequireNamesBounded(const google::protobuf::RepeatedPtrField<std::string>& names, int most) {
  Require(names.size() <= most);
  for (const std::string& name : names) {
    Require(!name.empty() && name.size() <= kMaxRegionNameBytes);
  }
}

// Each member's pieces of the group's regions (in name order, as the store lays them out) must lie
// inside their regions, follow each other without gap or overlap, and cover each region whole.
void CutIntoShards(const std::vector<uint64_t>& sizes, uint32_t members) {
  std::vector<uint64_t> covered(sizes.size(), 0);
  for (uint32_t index = 0; index < members; ++index) {
    const std::vector<ShardPiece> pieces = ShardPieces(sizes, members, index);
    Require(pieces.size() == sizes.size());
    for (size_t region = 0; region < sizes.size(); ++region) {
      const ShardPiece& piece = pieces[region];
      if (piece.bytes == 0) continue;
      Require(piece.offset == covered[region]);
      Require(piece.bytes <= sizes[region] - piece.offset);
      covered[region] += piece.bytes;
    }
  }
  for (size_t region = 0; region < sizes.size(); ++region) Require(covered[region] == sizes[region]);
}

void UseRegistration(const v1::RegisterRegionsRequest& request) {
  Require(request.regions_size() <= kMaxRegionsPerRegistration);
  std::set<std::string> names;
  uint64_t total = 0;
  // Per replica group: its members as its first region names them, and its regions' sizes by name.
  std::map<std::string, const v1::ReplicaGroup*> groups;
  std::map<std::string, std::map<std::string, uint64_t>> group_regions;
  bool groups_agree = true;
  for (const v1::RegionSpec& spec : request.regions()) {
    Require(!spec.name().empty() && spec.name().size() <= kMaxRegionNameBytes);
    Require(names.insert(spec.name()).second);
    Require(spec.dtype().size() <= kMaxDtypeBytes);
    Require(spec.shape_size() <= kMaxShapeDimensions);
    for (int64_t dimension : spec.shape()) Require(dimension >= 0);
    Require(spec.bytes() > 0 && spec.bytes() <= kMaxRegionBytes);
    Require(!__builtin_add_overflow(total, spec.bytes(), &total));
    if (spec.device() == v1::DEVICE_CUDA) {
      Require(spec.handle().cuda_memory_handle().size() == kCudaIpcHandleBytes);
      Require(spec.handle().cuda_event_handle().empty() ||
              spec.handle().cuda_event_handle().size() == kCudaIpcHandleBytes);
      Require(spec.handle().cuda_device() >= 0);
    } else {
      Require(spec.device() == v1::DEVICE_HOST);
    }
    if (!spec.has_replica_group()) continue;
    const v1::ReplicaGroup& group = spec.replica_group();
    Require(group.ranks_size() >= 1 &&
            static_cast<size_t>(group.ranks_size()) <= kMaxReplicaGroupRanks);
    Require(MemberIndex(request.rank(), group) < static_cast<uint32_t>(group.ranks_size()));
    auto [first, added] = groups.emplace(group.name(), &group);
    if (!added && !SameMembers(*first->second, group)) groups_agree = false;
    group_regions[group.name()][spec.name()] = spec.bytes();
  }
  // Groups whose regions disagree on the members are refused by the store, which sees the rank's
  // other registrations too.
  if (!groups_agree) return;
  for (const auto& [name, regions] : group_regions) {
    std::vector<uint64_t> sizes;
    for (const auto& [region, bytes] : regions) sizes.push_back(bytes);
    CutIntoShards(sizes, static_cast<uint32_t>(groups.at(name)->ranks_size()));
  }
}

void UseSnapshot(const v1::SnapshotRequest& request) {
  Require(StepInBounds(request.step()));
  RequireNamesBounded(request.regions(), kMaxNamesPerRequest);
  // The step after this one (the upstream log's pruning, a rank's replay) is representable.
  int64_t next = 0;
  Require(!__builtin_add_overflow(request.step(), int64_t{1}, &next));
  if (!request.has_sparse()) return;
  const v1::SparseSlot& sparse = request.sparse();
  Require(StepInBounds(sparse.window_first_step()));
  Require(sparse.window_size() > 0 && sparse.slot() < sparse.window_size());
  int64_t slot_step = 0;
  Require(!__builtin_add_overflow(sparse.window_first_step(), int64_t{sparse.slot()}, &slot_step));
  Require(slot_step == request.step());
  Require(sparse.buffer() < kSparseBuffers);
  RequireNamesBounded(sparse.operators(), kMaxOperatorsPerSlot);
}

// An accepted record goes into a log, comes back whole from the fetch of its key (which the fetch
// check accepts too), and is gone once the recovery point reaches its step.
void UseLogRecord(const v1::LogRecord& record) {
  Require(StepInBounds(record.step()));
  Require(record.rank() != record.peer_rank());
  std::optional<int64_t> recovery_point;
  UpstreamLog log(0, {.max_bytes = uint64_t{1} << 20},
                  [&](const std::set<uint32_t>&) { return recovery_point; });
  if (!log.Append(record).ok()) return;  // larger than the budget
  Require(log.Append(record).ok());      // the same record again is accepted once
  v1::FetchLogRequest fetch;
  fetch.set_rank(record.rank());
  fetch.set_step(record.step());
  fetch.set_direction(record.direction());
  fetch.set_peer_rank(record.peer_rank());
  Require(CheckFetchLog(fetch).ok());
  absl::StatusOr<v1::FetchLogResponse> fetched = log.Fetch(fetch);
  Require(fetched.ok() && fetched->records_size() == 1);
  const v1::LogRecord& back = fetched->records(0);
  Require(back.payload() == record.payload() && back.micro_batch() == record.micro_batch() &&
          back.step() == record.step() && back.direction() == record.direction());
  recovery_point = record.step();
  Require(log.Fetch(fetch).status().code() == absl::StatusCode::kOutOfRange);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t kind = data[0] % 10;
  ++data;
  --size;
  switch (kind) {
    case 0: {
      v1::RegisterRegionsRequest request;
      if (Parse(data, size, &request) && CheckRegisterRegions(request).ok()) {
        UseRegistration(request);
      }
      break;
    }
    case 1: {
      v1::SnapshotRequest request;
      if (Parse(data, size, &request) && CheckSnapshot(request).ok()) UseSnapshot(request);
      break;
    }
    case 2: {
      v1::WaitRequest request;
      if (Parse(data, size, &request) && CheckWait(request).ok()) {
        Require(StepInBounds(request.step()));
      }
      break;
    }
    case 3: {
      v1::RestoreRequest request;
      if (Parse(data, size, &request) && CheckRestore(request).ok()) {
        Require(!request.has_step() || StepInBounds(request.step()));
        RequireNamesBounded(request.regions(), kMaxNamesPerRequest);
        Require(!request.has_source_rank() || request.source_rank() == request.rank() ||
                !request.has_step());
      }
      break;
    }
    case 4: {
      v1::AppendLogRequest request;
      if (Parse(data, size, &request) && CheckAppendLog(request).ok()) {
        UseLogRecord(request.record());
      }
      break;
    }
    case 5: {
      v1::FetchLogRequest request;
      if (Parse(data, size, &request) && CheckFetchLog(request).ok()) {
        Require(StepInBounds(request.step()));
        Require(request.direction() == v1::LOG_DIRECTION_FORWARD ||
                request.direction() == v1::LOG_DIRECTION_BACKWARD);
        Require(request.rank() != request.peer_rank());
      }
      break;
    }
    case 6: {
      v1::InspectStepRequest request;
      if (Parse(data, size, &request) && CheckInspectStep(request).ok()) {
        Require(StepInBounds(request.step()));
      }
      break;
    }
    case 7: {
      v1::DropStepRequest request;
      if (Parse(data, size, &request) && CheckDropStep(request).ok()) {
        Require(StepInBounds(request.step()));
      }
      break;
    }
    case 8: {
      v1::VerifyRequest request;
      if (Parse(data, size, &request) && CheckVerify(request).ok()) {
        Require(!request.has_step() || StepInBounds(request.step()));
      }
      break;
    }
    default: {
      v1::ExportRequest request;
      if (Parse(data, size, &request) && CheckExport(request).ok()) {
        Require(!request.has_step() || StepInBounds(request.step()));
        Require(request.tier() == v1::TIER_UNSPECIFIED || request.tier() == v1::TIER_MEMORY ||
                request.tier() == v1::TIER_DURABLE);
      }
      break;
    }
  }
  return 0;
}
