// This node's folder of drained steps, <directory>/node-<id>: a complete step is the folder
// step-<S>, made visible by one rename once its files and the folder itself are synced; a step
// being written is .partial-step-<S>, one being deleted .deleting-step-<S>. A listing shows only
// complete steps, so a daemon killed at any instant never leaves a partial step listed.
#ifndef MOESNAP_DAEMON_DURABLE_DURABLE_DIRECTORY_H_
#define MOESNAP_DAEMON_DURABLE_DURABLE_DIRECTORY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moesnap::daemon::durable {

// Thread-safe (it holds no state but its path); each step is written by one drain at a time.
class DurableDirectory {
 public:
  DurableDirectory(const std::string& root, uint32_t node_id);

  const std::string& path() const { return path_; }
  uint32_t node_id() const { return node_id_; }

  // Creates the node folder (mode 0700) and any missing parent.
  absl::Status Create() const;
  // Removes what a killed drain or deletion left (.partial-* and .deleting-* folders); returns how
  // many.
  absl::StatusOr<int> RemoveLeftovers() const;
  // Complete steps, oldest first. Names that are not step-<integer> are ignored.
  absl::StatusOr<std::vector<int64_t>> Steps() const;

  std::string StepPath(int64_t step) const;
  // A fresh, empty folder for writing `step` (a leftover of an earlier attempt is removed first).
  absl::StatusOr<std::string> CreatePartial(int64_t step) const;
  // Syncs the partial folder, renames it to the step's name (atomically replacing a complete
  // folder of the same step, from an abandoned run) and syncs the node folder.
  absl::Status Publish(int64_t step) const;
  // Removes a partial folder after a failed write.
  void Discard(int64_t step) const;
  // Takes a complete step out of the listing (one rename), then deletes its files.
  absl::Status Remove(int64_t step) const;
  // Bytes of a complete step's files.
  absl::StatusOr<uint64_t> StepBytes(int64_t step) const;

 private:
  std::string PartialPath(int64_t step) const;

  const std::string path_;
  const uint32_t node_id_;
};

// fsync of a folder, so that a rename or a new file in it survives a power loss.
absl::Status SyncDirectory(const std::string& path);
// A status naming `what` and errno's text.
absl::Status ErrnoStatus(int error, const std::string& what);

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_DURABLE_DIRECTORY_H_
