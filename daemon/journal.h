// The metadata journal: which committed version of which region lives where in the pool. It is a
// shared-memory file beside the pool with two slots; each write replaces the older slot with the
// whole state, stamped with a sequence number and a CRC-32C. A daemon killed at any instant leaves
// at least one slot intact, and a restart reads the newest intact one: the last committed state,
// never a torn one.
#ifndef MOESNAP_DAEMON_JOURNAL_H_
#define MOESNAP_DAEMON_JOURNAL_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/shared_memory.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

// Not thread-safe: the store serializes writes under its own lock.
class Journal {
 public:
  // Two slots of 32 KiB at least: below that no real state fits.
  static constexpr uint64_t kMinimumBytes = 64 * 1024;

  // Maps /dev/shm/<pool_name>.journal, creating it with `bytes` bytes (mode 0600) if absent.
  // DATA_LOSS, naming its size, for an existing file of fewer than kMinimumBytes.
  static absl::StatusOr<std::unique_ptr<Journal>> OpenOrCreate(const std::string& pool_name,
                                                               uint64_t bytes);

  // The newest intact state (empty when the journal is new), and its sequence number.
  const v1::JournalState& recovered_state() const { return recovered_; }
  int64_t sequence() const { return sequence_; }

  // Makes the journal's state the JournalState serialized as `payload`, the pieces' concatenation
  // (a caller that holds parts of it serialized passes them as they are). RESOURCE_EXHAUSTED when
  // it does not fit a slot.
  absl::Status Write(absl::Span<const std::string_view> payload);
  // OK when a state of `payload_bytes` fits a slot; else RESOURCE_EXHAUSTED, saying how large the
  // journal must be.
  absl::Status Room(uint64_t payload_bytes) const;

  // Fault injection for the crash tests: SIGKILL this process half-way through the payload of the
  // write that would produce sequence number `sequence` (0: never), proving a torn slot is never
  // read back. moesnapd sets it from MOESNAP_CRASH_IN_JOURNAL_WRITE.
  void set_crash_in_write_for_testing(int64_t sequence) { crash_in_write_ = sequence; }

 private:
  explicit Journal(SharedMemory memory) : memory_(std::move(memory)) {}
  void Recover();
  uint64_t slot_bytes() const { return memory_.size() / 2; }

  SharedMemory memory_;
  v1::JournalState recovered_;
  int64_t sequence_ = 0;
  int64_t crash_in_write_ = 0;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_JOURNAL_H_
