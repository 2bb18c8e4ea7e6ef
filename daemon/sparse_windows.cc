// SparseWindows: the rules a sparse slot must keep, and how slots move a rank's windows.
#include "daemon/sparse_windows.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moesnap::daemon {

absl::Status SparseWindows::Check(uint32_t rank, int64_t step,
                                  const v1::SparseSlot& sparse) const {
  const auto where = [&] {
    return absl::StrCat("step ", step, " of rank ", rank, " as slot ", sparse.slot(),
                        " of the window from step ", sparse.window_first_step());
  };
  if (sparse.slot() == 0) {
    if (committed_ && committed_->buffer() == sparse.buffer()) {
      return absl::FailedPreconditionError(absl::StrCat(
          where(), ": buffer ", sparse.buffer(), " holds the last committed window (from step ",
          committed_->first_step(), "), kept until the next window commits; write the other one"));
    }
    if (!open_) return absl::OkStatus();
    for (const v1::WindowSlot& slot : open_->slots()) {
      if (slot.state() == v1::STEP_STATE_CAPTURING || slot.state() == v1::STEP_STATE_CAPTURED) {
        return absl::FailedPreconditionError(absl::StrCat(
            where(), ": slot ", slot.slot(), " (step ", slot.step(), ") of the open window from step ",
            open_->first_step(), " is not committed yet; WaitCommitted(", slot.step(), ") first"));
      }
    }
    return absl::OkStatus();
  }
  if (!open_ || open_->first_step() != sparse.window_first_step() ||
      open_->size() != sparse.window_size() || open_->buffer() != sparse.buffer()) {
    return absl::FailedPreconditionError(absl::StrCat(
        where(), " (", sparse.window_size(), " steps, buffer ", sparse.buffer(), "): the rank's open "
        "window is ",
        open_ ? absl::StrCat("the one from step ", open_->first_step(), " (", open_->size(),
                             " steps, buffer ", open_->buffer(), ")")
              : "none",
        "; a window starts with its slot 0"));
  }
  const int64_t expected = open_->slots().empty() ? 0 : open_->slots().rbegin()->slot() + 1;
  if (sparse.slot() != expected) {
    return absl::FailedPreconditionError(absl::StrCat(where(), ": the window's next slot is ",
                                                      expected));
  }
  return absl::OkStatus();
}

std::string SparseWindows::FailureOf(const v1::SparseSlot& sparse) const {
  if (!open_ || open_->first_step() != sparse.window_first_step()) return "";
  return open_->failure();
}

absl::Status SparseWindows::Add(int64_t step, const v1::SparseSlot& sparse, v1::StepState state) {
  if (sparse.slot() == 0) {
    open_.emplace();
    open_->set_first_step(sparse.window_first_step());
    open_->set_size(sparse.window_size());
    open_->set_buffer(sparse.buffer());
  } else if (!open_ || open_->first_step() != sparse.window_first_step() ||
             open_->size() != sparse.window_size() || open_->buffer() != sparse.buffer()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " as slot ", sparse.slot(), " of the window from step ",
        sparse.window_first_step(), " (", sparse.window_size(), " steps, buffer ", sparse.buffer(),
        ") is not recorded: ",
        open_ ? absl::StrCat("the open window is the one from step ", open_->first_step(), " (",
                             open_->size(), " steps, buffer ", open_->buffer(), ")")
              : "no window is open",
        "; a window starts with its slot 0"));
  }
  v1::WindowSlot* slot = open_->add_slots();
  slot->set_slot(sparse.slot());
  slot->set_step(step);
  slot->set_state(state);
  *slot->mutable_operators() = sparse.operators();
  return absl::OkStatus();
}

bool SparseWindows::Mark(int64_t step, const v1::SparseSlot& sparse, v1::StepState state) {
  if (!open_ || open_->first_step() != sparse.window_first_step()) return false;
  for (v1::WindowSlot& slot : *open_->mutable_slots()) {
    if (slot.step() == step) slot.set_state(state);
  }
  return true;
}

void SparseWindows::Fail(int64_t step, const v1::SparseSlot& sparse, const std::string& why) {
  if (Mark(step, sparse, v1::STEP_STATE_ABORTED) && open_->failure().empty()) {
    open_->set_failure(why);
  }
}

void SparseWindows::Commit(int64_t step, const v1::SparseSlot& sparse) {
  if (!Mark(step, sparse, v1::STEP_STATE_COMMITTED)) return;
  const auto committed_slots = static_cast<uint32_t>(
      std::count_if(open_->slots().begin(), open_->slots().end(), [](const v1::WindowSlot& slot) {
        return slot.state() == v1::STEP_STATE_COMMITTED;
      }));
  if (committed_slots == open_->size()) {
    committed_ = std::move(open_);
    open_.reset();
  }
}

v1::RankWindows SparseWindows::Describe(uint32_t rank) const {
  v1::RankWindows windows;
  windows.set_rank(rank);
  if (committed_) *windows.mutable_committed_window() = *committed_;
  if (open_) *windows.mutable_open_window() = *open_;
  return windows;
}

void SparseWindows::SaveTo(v1::JournalRank* saved) const {
  if (committed_) *saved->mutable_committed_window() = *committed_;
  if (!open_) return;
  v1::SparseWindow* open = saved->mutable_open_window();
  *open = *open_;
  open->clear_slots();
  for (const v1::WindowSlot& slot : open_->slots()) {
    if (slot.state() == v1::STEP_STATE_COMMITTED) *open->add_slots() = slot;
  }
}

SparseWindows SparseWindows::LoadFrom(const v1::JournalRank& saved) {
  SparseWindows windows;
  if (saved.has_committed_window()) windows.committed_ = saved.committed_window();
  if (saved.has_open_window()) windows.open_ = saved.open_window();
  return windows;
}

}  // namespace moesnap::daemon
