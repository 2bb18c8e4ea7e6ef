// The upstream log: what each pipeline stage of this node sent across its boundaries (activations
// downstream, gradients upstream), kept in daemon memory so that a failed neighbouring stage can
// replay its lost steps from it while the other stages wait instead of recomputing.
//
// Records are keyed (step, sender rank, direction, receiver rank, micro-batch). Appending the same
// key again is accepted when the bytes are equal (a replay re-logging what it resends) and refused
// when they differ. Memory is bounded by upstream_log.max_bytes: an append that does not fit once
// records no longer needed are dropped is refused with RESOURCE_EXHAUSTED, and the step is marked
// so that a later fetch of it fails naming why instead of returning a partial step. Records of
// steps up to the recovery point of the ranks that logged here (Store::LogRecoveryPoint: the first
// step of their last committed window) are dropped: no replay starts before it. The log lives in
// the daemon's heap: a restarted daemon starts with an empty one.
//
// Thread-safe.
#ifndef MOESNAP_DAEMON_UPSTREAM_LOG_H_
#define MOESNAP_DAEMON_UPSTREAM_LOG_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

struct UpstreamLogOptions {
  uint64_t max_bytes = uint64_t{1} << 30;
};

class UpstreamLog {
 public:
  // `recovery_point(ranks)`: the step up to which records of `ranks` are no longer needed, if any.
  using RecoveryPoint = std::function<std::optional<int64_t>(const std::set<uint32_t>& ranks)>;
  UpstreamLog(uint32_t node_id, const UpstreamLogOptions& options, RecoveryPoint recovery_point)
      : node_id_(node_id), options_(options), recovery_point_(std::move(recovery_point)) {}

  // A step's records from one rank to one neighbour in one direction come back in one fetch answer,
  // which must stay under the 64 MiB message limit of clients and peers: a record that would take
  // them past kMaxFetchBytes is refused like one that does not fit the budget.
  static constexpr uint64_t kMaxFetchBytes = uint64_t{48} << 20;
  // `record` passed CheckAppendLog (request_checks.h).
  absl::StatusOr<v1::AppendLogResponse> Append(const v1::LogRecord& record);
  // NOT_FOUND when this node has never held a record of the rank (it ran elsewhere); OUT_OF_RANGE
  // for a step already dropped; DATA_LOSS for a step whose records did not fit. Each record's
  // CRC-32C is checked before it is returned.
  absl::StatusOr<v1::FetchLogResponse> Fetch(const v1::FetchLogRequest& request);
  // Records, bytes, budget and the first step kept, into an admin view.
  void Describe(v1::ListWindowsResponse* response) const;

 private:
  // (step, sender, direction, receiver, micro-batch)
  using Key = std::tuple<int64_t, uint32_t, int, uint32_t, uint32_t>;
  struct Entry {
    std::string payload;
    uint32_t crc = 0;
  };
  static uint64_t Footprint(const std::string& payload);
  // The footprint of the records one fetch of `key`'s step, sender, direction and receiver answers.
  uint64_t FetchFootprint(const Key& key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Drops what no recovery can need any more.
  void Prune() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const uint32_t node_id_;
  const UpstreamLogOptions options_;
  const RecoveryPoint recovery_point_;  // takes the store's lock: always after mutex_, never before
  mutable absl::Mutex mutex_;
  std::map<Key, Entry> records_ ABSL_GUARDED_BY(mutex_);
  std::set<std::pair<int64_t, uint32_t>> refused_ ABSL_GUARDED_BY(mutex_);  // (step, sender)
  std::set<uint32_t> senders_ ABSL_GUARDED_BY(mutex_);  // every rank that ever appended here
  uint64_t bytes_ ABSL_GUARDED_BY(mutex_) = 0;
  std::optional<int64_t> dropped_through_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_UPSTREAM_LOG_H_
