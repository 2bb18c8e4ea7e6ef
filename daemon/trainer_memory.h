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
#include "daemon/process_exit.h"

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
// region, a copy in flight, the retention of a dead trainer's memory) lets go. Immutable.
class TrainerMemory {
 public:
  // Files larger than this are refused: no trainer shares more host memory in one file.
  static constexpr uint64_t kMaxBytes = uint64_t{1} << 40;
  // With `keep_descriptor`, files of a fixed size (sealed against shrinking and growing) of at
  // least this many bytes keep a descriptor, so that the rank's next process can be handed the
  // file (see TrainerSessions::Adopt); smaller ones cost less to allocate again than a descriptor
  // to hold.
  static constexpr uint64_t kMinKeptBytes = uint64_t{1} << 20;

  // Maps the whole of `fd` (a regular file: memfd or /dev/shm) read-write and shared. Does not
  // take ownership of `fd` (it duplicates it when it keeps a descriptor). The file must belong to
  // `owner` (the trainer that handed it over), and be none of `refused` (the daemon's own files):
  // PERMISSION_DENIED otherwise.
  static absl::StatusOr<std::shared_ptr<TrainerMemory>> Map(
      int fd, uid_t owner, const std::vector<FileIdentity>& refused, bool keep_descriptor = false);
  ~TrainerMemory();
  TrainerMemory(const TrainerMemory&) = delete;
  TrainerMemory& operator=(const TrainerMemory&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  // The size of the huge pages the file is made of (hugetlbfs); 0 for ordinary shared memory.
  uint64_t huge_page_bytes() const { return huge_page_bytes_; }
  // The trainer can no longer shrink the file (memfd seal), so reading it can never fault.
  bool shrink_sealed() const { return shrink_sealed_; }
  // The uid that owns the file.
  uid_t owner() const { return owner_; }
  // The daemon's descriptor of the file, for handing it to the rank's next process; -1 when the
  // file is not one to hand on (not kept, its size not sealed, or small).
  int kept_fd() const { return fd_; }

 private:
  TrainerMemory(uint8_t* data, uint64_t bytes, uint64_t huge_page_bytes, bool shrink_sealed,
                uid_t owner, int fd)
      : data_(data),
        bytes_(bytes),
        huge_page_bytes_(huge_page_bytes),
        shrink_sealed_(shrink_sealed),
        owner_(owner),
        fd_(fd) {}

  uint8_t* const data_;
  const uint64_t bytes_;
  const uint64_t huge_page_bytes_;
  const bool shrink_sealed_;
  const uid_t owner_;
  const int fd_;
};

// The sessions of trainer ranks and the memory each handed over. A rank has one current session,
// started by its Hello; a new Hello ends the previous one, unless that one is live and belongs to
// another user. The session's token is its secret: the trainer presents it on every later call, so
// a call acts for the rank its session was bound to, whatever rank it names. Thread-safe.
//
// Memory a trainer leaves when it exits is kept for the rank's next process for `retention` (zero:
// released at once): a restarted trainer takes a file of the size it needs (Adopt) instead of
// allocating, filling and mapping fresh shared memory, and the daemon's mapping of it is reused.
// Only files that can be handed on (TrainerMemory::kept_fd), at most kMaxKeptFilesPerRank of a
// rank (its largest), only to a process of the file's owner, only once the process that handed them
// over has exited and its memory connection has closed (no process that inherited it, such as a
// forked worker, holds it any more), and only while no capture or restore of the rank runs. What
// the daemon cannot see, it does not hand on: a trainer in another pid namespace keeps nothing.
class TrainerSessions {
 public:
  // Most files one session may hand over.
  static constexpr size_t kMaxMemoriesPerSession = size_t{1} << 20;
  // A session whose trainer has not opened its memory connection this long after Hello is not
  // live: the trainer died between the two (a live client opens it right after Hello).
  static constexpr absl::Duration kMemoryConnectionGrace = absl::Seconds(10);
  // Most sessions at once: a node's trainers, with room for restarts. A Hello at the bound first
  // ends the sessions that are not live by the rule above (a peer calling Hello for rank after
  // rank without ever connecting its memory cannot grow the daemon without bound).
  static constexpr size_t kMaxSessions = 4096;
  // Most files kept for a rank's next process: a registration's file each (the Python package
  // makes one per registration), not every buffer of a trainer that allocates one per tensor.
  static constexpr size_t kMaxKeptFilesPerRank = 16;

  struct Session {
    uint64_t number = 0;  // increasing; the store keys a rank's registrations by it
    std::string token;    // the secret the memory handoff and every later call present
    // Sessions ended to make room (kMaxSessions), as (rank, number): their registrations go too.
    std::vector<std::pair<uint32_t, uint64_t>> abandoned;
  };
  // Who called Hello (the connection's credentials).
  struct Caller {
    uid_t uid = 0;
    pid_t pid = 0;
  };

  // Kept memory of exited trainers stays within `max_kept_bytes`: a trainer that exits makes room
  // for its files by releasing the memory kept longest (its own largest files that still do not
  // fit are released).
  explicit TrainerSessions(absl::Duration retention = absl::ZeroDuration(),
                           absl::Duration connection_grace = kMemoryConnectionGrace,
                           uint64_t max_kept_bytes = UINT64_MAX)
      : retention_(retention), connection_grace_(connection_grace),
        max_kept_bytes_(max_kept_bytes) {}
  // Whether memory of exited trainers is kept (the retention is not zero).
  bool keeps_exited_memory() const { return retention_ > absl::ZeroDuration(); }

  // Starts `rank`'s new session for `caller`; the rank's memory from earlier sessions is no longer
  // found. PERMISSION_DENIED, naming the holder, while the rank's current session is live (its
  // memory connection open, or within the connection grace of its Hello) and belongs to another
  // uid than `caller`'s, unless the caller is root: users do not take each other's ranks, while a
  // process of the same user (which could read the trainer's memory anyway) may take over.
  // RESOURCE_EXHAUSTED when kMaxSessions live sessions are open.
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
  // Binds the session `token` names to its memory connection, whose peer `process` is watched:
  // only a watched session's memory is kept, and handed on once it has exited. Once per session:
  // FAILED_PRECONDITION for a second connection; NOT_FOUND for a token that names no session.
  absl::Status Bind(const std::string& token, ProcessExit process);
  // The memory connection of the session `token` names closed. Ends the session: returns its rank
  // and number when it was the rank's current session, so the rank's registrations can go too. The
  // files it can hand on are kept for the rank's next process (replacing what the rank kept
  // before), as they are when a new Hello of the rank replaces the session; those are handed on
  // only once this is called for the replaced session too.
  struct Ended {
    uint32_t rank = 0;
    uint64_t number = 0;
    uint64_t kept_bytes = 0;  // kept for the rank's next process
  };
  std::optional<Ended> End(const std::string& token);

  struct Adopted {
    uint64_t id = 0;  // in the session, as Add's ids
    std::shared_ptr<TrainerMemory> memory;
  };
  // Adds to the session `token` names a file holding `bytes` bytes kept from an earlier process of
  // its rank (memory_handoff::FileBytesFor: of exactly that size, or in huge pages rounded up to
  // whole ones), with a new id. The file holds that process's bytes, not zeros. NOT_FOUND, saying
  // why, when none is to be had: none kept of that size, the earlier process still runs or its
  // memory connection is still open, the file belongs to another uid than `caller`, or `copying`
  // (the store's word) says a capture or restore of the rank's memory is queued or running.
  absl::StatusOr<Adopted> Adopt(const std::string& token, uint64_t bytes, uid_t caller,
                                bool copying);
  // What is kept for `rank` expires now (its new process took what it needed: it snapshots); the
  // next ReleaseExpired releases it, so that a caller's thread never unmaps it.
  void ExpireKept(uint32_t rank);
  // Releases kept memory whose time is over; returns when the next kept memory's time ends
  // (absl::InfiniteFuture() when none is kept).
  absl::Time ReleaseExpired(absl::Time now);

  struct Retention {
    uint64_t kept_bytes = 0;  // of exited trainers, waiting for their ranks' next processes
    uint64_t kept_files = 0;
    uint64_t adopted_bytes_total = 0;
    uint64_t bound_released_bytes_total = 0;  // released early to stay within max_kept_bytes
  };
  Retention retention() const;

  // The memory the sessions handed over (or took over), by the pages it is made of.
  struct Shared {
    uint64_t huge_page_bytes = 0;
    uint64_t ordinary_bytes = 0;
  };
  Shared shared() const;

 private:
  struct State {
    uint32_t rank = 0;
    uint64_t number = 0;
    Caller caller;
    absl::Time started;
    bool connected = false;  // its memory connection handed over memory (and is open)
    bool bound = false;      // its memory connection is open (Bind, until End)
    ProcessExit process;
    std::map<uint64_t, std::shared_ptr<TrainerMemory>> memories;
  };

  // What a rank's exited process left, for its next one.
  struct Kept {
    std::string token;  // of the session that handed the memory over
    absl::Time until;
    ProcessExit process;
    bool connection_open = false;  // that session's memory connection (End not called yet)
    std::vector<std::shared_ptr<TrainerMemory>> memories;  // largest first
  };

  // The session `token` names: NOT_FOUND, saying so, when it is none.
  absl::StatusOr<State*> FindLocked(const std::string& token) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Adds `memories` to `session` with consecutive ids from the one returned; RESOURCE_EXHAUSTED,
  // adding none, past kMaxMemoriesPerSession.
  absl::StatusOr<uint64_t> AddLocked(State& session,
                                     std::vector<std::shared_ptr<TrainerMemory>> memories)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Keeps what `session` (of `token`) can hand on for its rank's next process, within
  // max_kept_bytes_; returns the bytes kept. What the rank kept before, and what goes to make room,
  // goes to `released`, to be unmapped after the lock.
  uint64_t RetireLocked(const std::string& token, State& session, std::vector<Kept>& released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  // Whether `session` may still be a trainer's: its memory connection open, or its Hello recent.
  bool MayBeLive(const State& session, absl::Time now) const;

  const absl::Duration retention_;
  const absl::Duration connection_grace_;
  const uint64_t max_kept_bytes_;
  mutable absl::Mutex mutex_;
  std::map<uint32_t, Kept> kept_ ABSL_GUARDED_BY(mutex_);  // by rank
  uint64_t adopted_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
  uint64_t bound_released_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
  uint64_t next_session_ ABSL_GUARDED_BY(mutex_) = 1;
  uint64_t next_memory_ ABSL_GUARDED_BY(mutex_) = 1;
  std::map<std::string, State> sessions_ ABSL_GUARDED_BY(mutex_);   // by token
  std::map<uint32_t, std::string> current_ ABSL_GUARDED_BY(mutex_);  // rank -> token
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_TRAINER_MEMORY_H_
