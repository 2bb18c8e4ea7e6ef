// UpstreamLog: bounded, idempotent storage of boundary records, dropped as windows commit.
#include "daemon/upstream_log.h"

#include "absl/strings/str_cat.h"
#include "common/byte_size.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {
namespace {

// Per-record bookkeeping charged to the budget besides the payload (map node, key, entry).
constexpr uint64_t kRecordOverhead = 128;

std::string DirectionName(v1::LogDirection direction) {
  switch (direction) {
    case v1::LOG_DIRECTION_FORWARD:
      return "activations";
    case v1::LOG_DIRECTION_BACKWARD:
      return "gradients";
    default:
      return "records";
  }
}

std::string RecordName(const v1::LogRecord& record) {
  return absl::StrCat(DirectionName(record.direction()), " of step ", record.step(),
                      " micro-batch ", record.micro_batch(), " from rank ", record.rank(),
                      " to rank ", record.peer_rank());
}

}  // namespace

uint64_t UpstreamLog::Footprint(const std::string& payload) {
  return payload.size() + kRecordOverhead;
}

uint64_t UpstreamLog::FetchFootprint(const Key& key) const {
  uint64_t bytes = 0;
  const Key first{std::get<0>(key), std::get<1>(key), std::get<2>(key), std::get<3>(key), 0};
  for (auto it = records_.lower_bound(first);
       it != records_.end() && std::get<0>(it->first) == std::get<0>(key) &&
       std::get<1>(it->first) == std::get<1>(key) && std::get<2>(it->first) == std::get<2>(key) &&
       std::get<3>(it->first) == std::get<3>(key);
       ++it) {
    bytes += Footprint(it->second.payload);
  }
  return bytes;
}

void UpstreamLog::Prune() {
  if (senders_.empty()) return;
  const std::optional<int64_t> step = recovery_point_(senders_);
  if (!step || (dropped_through_ && *step <= *dropped_through_)) return;
  dropped_through_ = step;
  auto end = records_.lower_bound(Key{*step + 1, 0, 0, 0, 0});
  for (auto it = records_.begin(); it != end; ++it) bytes_ -= Footprint(it->second.payload);
  records_.erase(records_.begin(), end);
  refused_.erase(refused_.begin(), refused_.lower_bound({*step + 1, 0}));
}

absl::StatusOr<v1::AppendLogResponse> UpstreamLog::Append(const v1::LogRecord& record) {
  const uint32_t crc = erasure::Crc32c(record.payload().data(), record.payload().size());
  const Key key{record.step(), record.rank(), record.direction(), record.peer_rank(),
                record.micro_batch()};
  absl::MutexLock lock(&mutex_);
  senders_.insert(record.rank());
  Prune();
  v1::AppendLogResponse response;
  response.set_budget_bytes(options_.max_bytes);
  if (dropped_through_ && record.step() <= *dropped_through_) {
    // Older than the last committed window: no recovery can need it.
    response.set_log_bytes(bytes_);
    return response;
  }
  if (auto it = records_.find(key); it != records_.end()) {
    if (it->second.crc != crc || it->second.payload.size() != record.payload().size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          RecordName(record), " is logged already with different bytes (", it->second.payload.size(),
          " bytes, CRC-32C ", absl::Hex(it->second.crc), "; now ", record.payload().size(),
          " bytes, ", absl::Hex(crc), "): the replay is not deterministic"));
    }
    response.set_log_bytes(bytes_);
    return response;
  }
  const uint64_t needed = Footprint(record.payload());
  if (const uint64_t answer = FetchFootprint(key) + needed; answer > kMaxFetchBytes) {
    refused_.insert({record.step(), record.rank()});
    return absl::ResourceExhaustedError(absl::StrCat(
        RecordName(record), " would make the step's records to rank ", record.peer_rank(), " ",
        FormatByteSize(answer), ", more than one fetch answers (", FormatByteSize(kMaxFetchBytes),
        "): the step is not logged"));
  }
  if (bytes_ + needed > options_.max_bytes) {
    refused_.insert({record.step(), record.rank()});
    return absl::ResourceExhaustedError(absl::StrCat(
        "upstream log of node ", node_id_, " is full: ", RecordName(record), " needs ",
        FormatByteSize(needed), " but ", FormatByteSize(bytes_), " of upstream_log.max_bytes = ",
        FormatByteSize(options_.max_bytes), " are held for steps after ",
        dropped_through_ ? absl::StrCat(*dropped_through_) : "0",
        "; they are freed as sparse windows commit (or raise upstream_log.max_bytes)"));
  }
  records_[key] = Entry{record.payload(), crc};
  bytes_ += needed;
  response.set_log_bytes(bytes_);
  return response;
}

absl::StatusOr<v1::FetchLogResponse> UpstreamLog::Fetch(const v1::FetchLogRequest& request) {
  absl::MutexLock lock(&mutex_);
  Prune();
  if (!senders_.contains(request.rank())) {
    return absl::NotFoundError(absl::StrCat("node ", node_id_, " holds no upstream log of rank ",
                                            request.rank()));
  }
  const std::string what = absl::StrCat(DirectionName(request.direction()), " of step ",
                                        request.step(), " from rank ", request.rank(), " to rank ",
                                        request.peer_rank(), " on node ", node_id_);
  if (dropped_through_ && request.step() <= *dropped_through_) {
    return absl::OutOfRangeError(absl::StrCat(what, ": dropped, as every step up to ",
                                              *dropped_through_, " (older than the last committed "
                                              "window)"));
  }
  if (refused_.contains({request.step(), request.rank()})) {
    return absl::DataLossError(absl::StrCat(what, ": not kept, the upstream log was full "
                                            "(upstream_log.max_bytes = ",
                                            FormatByteSize(options_.max_bytes), ")"));
  }
  v1::FetchLogResponse response;
  response.set_node_id(node_id_);
  const Key first{request.step(), request.rank(), request.direction(), request.peer_rank(), 0};
  for (auto it = records_.lower_bound(first);
       it != records_.end() && std::get<0>(it->first) == request.step() &&
       std::get<1>(it->first) == request.rank() && std::get<2>(it->first) == request.direction() &&
       std::get<3>(it->first) == request.peer_rank();
       ++it) {
    const uint32_t crc = erasure::Crc32c(it->second.payload.data(), it->second.payload.size());
    if (crc != it->second.crc) {
      return absl::DataLossError(absl::StrCat(what, ": micro-batch ", std::get<4>(it->first),
                                              " is corrupt in memory (CRC-32C ", absl::Hex(crc),
                                              ", logged ", absl::Hex(it->second.crc), ")"));
    }
    v1::LogRecord* record = response.add_records();
    record->set_rank(request.rank());
    record->set_step(request.step());
    record->set_micro_batch(std::get<4>(it->first));
    record->set_direction(request.direction());
    record->set_peer_rank(request.peer_rank());
    record->set_payload(it->second.payload);
    record->set_crc(crc);
  }
  return response;
}

void UpstreamLog::Describe(v1::ListWindowsResponse* response) const {
  absl::MutexLock lock(&mutex_);
  response->set_log_records(records_.size());
  response->set_log_bytes(bytes_);
  response->set_log_budget_bytes(options_.max_bytes);
  if (dropped_through_) response->set_log_kept_from_step(*dropped_through_ + 1);
}

}  // namespace moesnap::daemon
