// Journal: two slots of [header | serialized JournalState]; the newest slot whose CRC matches wins.
#include "daemon/journal.h"

#include <csignal>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {
namespace {

// Registered when the program starts, so a scrape sees them at zero before the first write.
metrics::Counter& journal_writes = metrics::Registry::Default().AddCounter(
    "moesnap_journal_writes_total", "Journal writes (each one a local commit point)");
metrics::Counter& journal_written_bytes = metrics::Registry::Default().AddCounter(
    "moesnap_journal_written_bytes_total", "Bytes of state written to the journal");

constexpr uint64_t kMagic = 0x4c4e524a534d4f4dULL;  // "MOMSJRNL"

struct SlotHeader {
  uint64_t magic;
  int64_t sequence;
  uint64_t payload_bytes;
  uint32_t crc;  // over sequence, payload_bytes and the payload
  uint32_t reserved;
};
static_assert(sizeof(SlotHeader) == 32);

// The slot's CRC before its payload: over the sequence and the payload's size.
uint32_t HeaderCrc(const SlotHeader& header) {
  const uint32_t crc = erasure::Crc32c(&header.sequence, sizeof(header.sequence));
  return erasure::Crc32cExtend(crc, &header.payload_bytes, sizeof(header.payload_bytes));
}

uint32_t SlotCrc(const SlotHeader& header, const uint8_t* payload) {
  return erasure::Crc32cExtend(HeaderCrc(header), payload, header.payload_bytes);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Journal>> Journal::OpenOrCreate(const std::string& pool_name,
                                                               uint64_t bytes) {
  if (bytes < kMinimumBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool.journal_bytes must be at least ", kMinimumBytes, ", got ", bytes));
  }
  const std::string name = pool_name + ".journal";
  absl::StatusOr<SharedMemory> memory = SharedMemory::Open(name, /*writable=*/true);
  if (absl::IsNotFound(memory.status())) {
    memory = SharedMemory::Create(name, bytes, {.reserve = true});
  }
  if (!memory.ok()) return memory.status();
  // Every journal made here has kMinimumBytes at least; a smaller file (cut short, or not this
  // daemon's) has slots too small for their headers, whose sizes would wrap below zero.
  if (memory->size() < kMinimumBytes) {
    return absl::DataLossError(absl::StrCat(
        "/dev/shm/", name, " is ", memory->size(), " bytes, smaller than the ", kMinimumBytes,
        " of any journal moesnapd writes (cut short, or not its file): move it away to start with "
        "an empty journal (the committed state it recorded is lost)"));
  }
  std::unique_ptr<Journal> journal(new Journal(*std::move(memory)));
  journal->Recover();
  return journal;
}

void Journal::Recover() {
  for (int slot = 0; slot < 2; ++slot) {
    const uint8_t* base = memory_.data() + slot * slot_bytes();
    SlotHeader header;
    std::memcpy(&header, base, sizeof(header));
    if (header.magic != kMagic || header.payload_bytes > slot_bytes() - sizeof(header)) continue;
    const uint8_t* payload = base + sizeof(header);
    if (SlotCrc(header, payload) != header.crc || header.sequence <= sequence_) continue;
    v1::JournalState state;
    if (!state.ParseFromArray(payload, static_cast<int>(header.payload_bytes))) continue;
    recovered_ = std::move(state);
    sequence_ = header.sequence;
  }
}

absl::Status Journal::Room(uint64_t payload_bytes) const {
  if (payload_bytes <= slot_bytes() - sizeof(SlotHeader)) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "a journal state of ", payload_bytes, " bytes does not fit a slot of /dev/shm/",
      memory_.name(), " (", slot_bytes() - sizeof(SlotHeader),
      " bytes): raise pool.journal_bytes to at least ", 2 * (payload_bytes + sizeof(SlotHeader))));
}

absl::Status Journal::Write(absl::Span<const std::string_view> payload) {
  uint64_t payload_bytes = 0;
  for (std::string_view piece : payload) payload_bytes += piece.size();
  if (absl::Status room = Room(payload_bytes); !room.ok()) return room;
  const int64_t next = sequence_ + 1;
  // Odd sequences go to slot 1, even to slot 0: the newest intact slot is never the one written.
  uint8_t* base = memory_.data() + (next % 2) * slot_bytes();
  SlotHeader header{kMagic, next, payload_bytes, 0, 0};
  // The payload is copied and checksummed in one pass, and the header written last: a write cut
  // short leaves the slot's older header, whose CRC no longer matches, and the slot is passed over.
  uint32_t crc = HeaderCrc(header);
  const uint64_t crash_at = next == crash_in_write_ ? payload_bytes / 2 : payload_bytes + 1;
  uint64_t copied = 0;
  for (std::string_view piece : payload) {
    if (copied + piece.size() >= crash_at) {
      std::memcpy(base + sizeof(header) + copied, piece.data(), crash_at - copied);
      std::raise(SIGKILL);
    }
    crc = erasure::CopyWithCrc32c(base + sizeof(header) + copied, piece.data(), piece.size(), crc);
    copied += piece.size();
  }
  if (next == crash_in_write_) std::raise(SIGKILL);  // an empty payload: before its header
  header.crc = crc;
  std::memcpy(base, &header, sizeof(header));
  sequence_ = next;
  journal_writes.Add();
  journal_written_bytes.Add(payload_bytes);
  return absl::OkStatus();
}

}  // namespace moesnap::daemon
