#include "daemon/abandon_mark.h"

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"

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
  if (!memory->shrink_sealed()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the abandon mark's memory ", request.memory(),
        " is not sealed against shrinking: reading the mark could fault"));
  }
  auto* count = reinterpret_cast<uint64_t*>(memory->data() + offset);
  return AbandonMark(std::move(memory), count, request.take());
}

bool AbandonMark::Abandoned() const {
  std::atomic_thread_fence(std::memory_order_seq_cst);  // every copy ended before the read
  return std::atomic_ref<uint64_t>(*count_).load(std::memory_order_seq_cst) >= take_;
}

}  // namespace moesnap::daemon
