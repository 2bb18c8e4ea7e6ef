// Trainer memory the daemon reads snapshots from and writes restores into: files a trainer handed
// over by descriptor (see common/memory_handoff_wire.h), each mapped once whatever the number of
// regions in it, grouped by the session of the rank that handed them over.
#ifndef MOESNAP_DAEMON_TRAINER_MEMORY_H_
#define MOESNAP_DAEMON_TRAINER_MEMORY_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace moesnap::daemon {

// Which file a descriptor or path names, whatever its name.
struct FileIdentity {
  dev_t device = 0;
  ino_t inode = 0;
  bool operator==(const FileIdentity& other) const {
    return device == other.device && inode == other.inode;
  }
};
// The identities of existing files; NOT_FOUND naming a path that is not there.
absl::StatusOr<std::vector<FileIdentity>> IdentifyFiles(const std::vector<std::string>& paths);

// One mapping of a trainer's shared-memory file. Unmapped when the last holder (a registered
// region, a copy in flight) lets go. Immutable.
class TrainerMemory {
 public:
  // Files larger than this are refused: no trainer shares more host memory in one file.
  static constexpr uint64_t kMaxBytes = uint64_t{1} << 40;

  // Maps the whole of `fd` (a regular file: memfd or /dev/shm) read-write and shared. Does not
  // take ownership of `fd`. The file must belong to `owner` (the trainer that handed it over), and
  // be none of `refused` (the daemon's own files): PERMISSION_DENIED otherwise.
  static absl::StatusOr<std::shared_ptr<TrainerMemory>> Map(
      int fd, uid_t owner, const std::vector<FileIdentity>& refused);
  ~TrainerMemory();
  TrainerMemory(const TrainerMemory&) = delete;
  TrainerMemory& operator=(const TrainerMemory&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  // The trainer can no longer shrink the file (memfd seal), so reading it can never fault.
  bool shrink_sealed() const { return shrink_sealed_; }

 private:
  TrainerMemory(uint8_t* data, uint64_t bytes, bool shrink_sealed)
      : data_(data), bytes_(bytes), shrink_sealed_(shrink_sealed) {}

  uint8_t* const data_;
  const uint64_t bytes_;
  const bool shrink_sealed_;
};

// The sessions of trainer ranks and the memory each handed over. A rank has one current session,
// started by its Hello; a new Hello ends the previous one, unless that one is live and belongs to
// another user. The session's token is its secret: the trainer presents it on every later call, so
// a call acts for the rank its session was bound to, whatever rank it names. Thread-safe.
class TrainerSessions {
 public:
  // Most files one session may hand over.
  static constexpr size_t kMaxMemoriesPerSession = size_t{1} << 20;
  // A session whose trainer has not opened its memory connection this long after Hello is not
  // live: the trainer died between the two (a live client opens it right after Hello).
  static constexpr absl::Duration kMemoryConnectionGrace = absl::Seconds(10);

  struct Session {
    uint64_t number = 0;  // increasing; the store keys a rank's registrations by it
    std::string token;    // the secret the memory handoff and every later call present
  };
  // Who called Hello (the connection's credentials).
  struct Caller {
    uid_t uid = 0;
    pid_t pid = 0;
  };

  // Starts `rank`'s new session for `caller`; the rank's memory from earlier sessions is no longer
  // found. PERMISSION_DENIED, naming the holder, while the rank's current session is live (its
  // memory connection open, or within kMemoryConnectionGrace of its Hello) and belongs to another
  // uid than `caller`'s, unless the caller is root: users do not take each other's ranks, while a
  // process of the same user (which could read the trainer's memory anyway) may take over.
  absl::StatusOr<Session> Start(uint32_t rank, const Caller& caller);
  // The rank whose current session `token` is: NOT_FOUND when it is none (never was, replaced by a
  // newer Hello of the rank, or ended when its trainer disconnected).
  absl::StatusOr<uint32_t> RankOf(const std::string& token) const;
  // Adds memories to the session `token` names, with consecutive ids from the one returned;
  // NOT_FOUND for a token that names no current session.
  absl::StatusOr<uint64_t> Add(const std::string& token,
                               std::vector<std::shared_ptr<TrainerMemory>> memories);
  // Memory `id` of `rank`'s current session: NOT_FOUND when the rank handed over no such memory.
  absl::StatusOr<std::shared_ptr<TrainerMemory>> Find(uint32_t rank, uint64_t id) const;
  // Ends the session `token` names (its handoff connection closed): returns its rank and number
  // when it was the rank's current session, so the rank's registrations can go too.
  std::optional<std::pair<uint32_t, uint64_t>> End(const std::string& token);

 private:
  struct State {
    uint32_t rank = 0;
    uint64_t number = 0;
    Caller caller;
    absl::Time started;
    bool connected = false;  // its memory connection handed over memory (and is open)
    std::map<uint64_t, std::shared_ptr<TrainerMemory>> memories;
  };

  mutable absl::Mutex mutex_;
  uint64_t next_session_ ABSL_GUARDED_BY(mutex_) = 1;
  uint64_t next_memory_ ABSL_GUARDED_BY(mutex_) = 1;
  std::map<std::string, State> sessions_ ABSL_GUARDED_BY(mutex_);   // by token
  std::map<uint32_t, std::string> current_ ABSL_GUARDED_BY(mutex_);  // rank -> token
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_TRAINER_MEMORY_H_
