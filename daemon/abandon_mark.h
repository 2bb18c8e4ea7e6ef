// A trainer's abandon mark (v1::AbandonMark): the count, in memory its session shared, that the
// trainer raises to a snapshot's take before it changes its regions without having heard that the
// snapshot's capture ended. The capture asks it once every copy of the snapshot has ended: a take
// the count reached may have been copied while the trainer wrote its next step.
//
// Why this is enough: the trainer raises the count and then writes its memory; the daemon ends its
// copies and then reads the count, each with a full fence between. If the daemon reads a count
// below the take, the trainer raised it after that read, so it wrote its memory after every copy.
#ifndef MOESNAP_DAEMON_ABANDON_MARK_H_
#define MOESNAP_DAEMON_ABANDON_MARK_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "daemon/trainer_memory.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

class AbandonMark {
 public:
  // The mark `request` places in `memory`, the session memory it names: INVALID_ARGUMENT unless
  // the count lies within the memory, 8-aligned, the trainer cannot shrink the memory, and the
  // take is one (from 1). The count is read under the bus-error guard all the same (a hole punched
  // in a huge-page file can fault).
  static absl::StatusOr<AbandonMark> In(std::shared_ptr<TrainerMemory> memory,
                                        const v1::AbandonMark& request);

  // Whether the trainer gave up waiting for this snapshot's capture.
  bool Abandoned() const;

 private:
  AbandonMark(std::shared_ptr<TrainerMemory> memory, const uint64_t* count, uint64_t take)
      : memory_(std::move(memory)), count_(count), take_(take) {}

  std::shared_ptr<TrainerMemory> memory_;  // keeps the count mapped
  const uint64_t* count_;
  uint64_t take_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_ABANDON_MARK_H_
