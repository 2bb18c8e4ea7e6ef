#include "daemon/abandon_mark.h"

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/bus_error_guard.h"

namespace moesnap::daemon {

absl::StatusOr<AbandonMark> AbandonMark::In(std::shared_ptr<TrainerMemory> memory,
                                            const v1::AbandonMark& request) {
  const uint64_t offset = request.offset();
  if (offset % alignof(uint64_t) != 0 || offset > memory->bytes() ||
      memory->bytes() - offset < sizeof(uint64_t)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the abandon mark at offset ", offset, " of memory ", request.memory(),
                     " is not an 8-aligned count within its ", memory->bytes(), " bytes"));
  }
  if (request.take() == 0) {
    return absl::InvalidArgumentError("an abandon mark's take is its Snapshot call's, from 1");
  }
  if (!memory->shrink_sealed()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the abandon mark's memory ", request.memory(),
        " is not sealed against shrinking: reading the mark could fault"));
  }
  InstallBusErrorGuard();  // for the reads of the count
  const auto* count = reinterpret_cast<const uint64_t*>(memory->data() + offset);
  return AbandonMark(std::move(memory), count, request.take());
}

bool AbandonMark::Abandoned() const {
  std::atomic_thread_fence(std::memory_order_seq_cst);  // every copy ended before the read
  uint64_t count = 0;
  // A count that cannot be read (the trainer took its pages away) gives no sign the trainer
  // waited: the capture is abandoned.
  return !GuardedLoad(count_, &count) || count >= take_;
}

}  // namespace moesnap::daemon
