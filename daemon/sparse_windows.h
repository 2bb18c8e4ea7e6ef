// A rank's sparse windows: the last one all of whose slots committed, and the open one after it.
// A sparse step is one slot of a window; the window commits when all its slots have, and the
// buffer of the committed window is kept until the next one commits.
#ifndef MOESNAP_DAEMON_SPARSE_WINDOWS_H_
#define MOESNAP_DAEMON_SPARSE_WINDOWS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon {

// Not thread-safe: the store holds it per rank, under its lock.
class SparseWindows {
 public:
  // Whether `step` may be slot `sparse`: slot 0 opens a window in the buffer not holding the
  // committed window, once every slot of the open one has settled; later slots continue the open
  // window in order. FAILED_PRECONDITION naming why not.
  absl::Status Check(uint32_t rank, int64_t step, const v1::SparseSlot& sparse) const;
  // Why the open window that `sparse` belongs to can no longer commit (a slot of it was skipped or
  // aborted); empty when it still can, or when `sparse` is of no open window.
  std::string FailureOf(const v1::SparseSlot& sparse) const;

  // Records `step` as slot `sparse` of the open window, in `state`. Slot 0 opens a new window (an
  // open one left incomplete is abandoned). A later slot is recorded only into the open window it
  // continues (its first step, size and buffer): FAILED_PRECONDITION, changing nothing, when no
  // window or another one is open. The order of slots is Check's to judge, before.
  absl::Status Add(int64_t step, const v1::SparseSlot& sparse, v1::StepState state);
  // Sets the state of slot `step`; false when `sparse` is not of the open window.
  bool Mark(int64_t step, const v1::SparseSlot& sparse, v1::StepState state);
  // Slot `step` will not commit (skipped or aborted): the open window can no longer commit, for
  // the first such reason `why`.
  void Fail(int64_t step, const v1::SparseSlot& sparse, const std::string& why);
  // Slot `step` committed; the open window becomes the committed one when that was its last.
  void Commit(int64_t step, const v1::SparseSlot& sparse);

  bool empty() const { return !committed_ && !open_; }
  const std::optional<v1::SparseWindow>& committed() const { return committed_; }
  const std::optional<v1::SparseWindow>& open() const { return open_; }
  v1::RankWindows Describe(uint32_t rank) const;

  // The journal's record of them: the committed window, and the open one with its committed slots
  // only (a rank recovered takes the window up after its last committed slot).
  void SaveTo(v1::JournalRank* saved) const;
  static SparseWindows LoadFrom(const v1::JournalRank& saved);

 private:
  std::optional<v1::SparseWindow> committed_;
  std::optional<v1::SparseWindow> open_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_SPARSE_WINDOWS_H_
