// TrainerMemory: fstat, seal check and one MAP_POPULATE mapping per file; TrainerSessions: tokens
// from the system's random source, memory ids unique across sessions, exited trainers' files kept
// by rank.
#include "daemon/trainer_memory.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/memory_handoff_wire.h"

namespace moesnap::daemon {

absl::StatusOr<std::vector<FileIdentity>> IdentifyFiles(const std::vector<std::string>& paths) {
  std::vector<FileIdentity> identities;
  for (const std::string& path : paths) {
    struct stat info {};
    if (stat(path.c_str(), &info) != 0) {
      return absl::NotFoundError(absl::StrCat("cannot stat ", path, ": ", std::strerror(errno)));
    }
    identities.push_back({info.st_dev, info.st_ino});
  }
  return identities;
}

absl::StatusOr<std::shared_ptr<TrainerMemory>> TrainerMemory::Map(
    int fd, uid_t owner, const std::vector<FileIdentity>& refused, bool keep_descriptor) {
  struct stat info {};
  if (fstat(fd, &info) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot stat the file: ", std::strerror(errno)));
  }
  if (!S_ISREG(info.st_mode)) {
    return absl::InvalidArgumentError("the descriptor is not a shared-memory file");
  }
  if (info.st_uid != owner) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the file is owned by uid ", info.st_uid, ", not by the trainer handing it over (uid ",
        owner, "): a trainer hands over its own memory only"));
  }
  const FileIdentity identity{info.st_dev, info.st_ino};
  for (const FileIdentity& own : refused) {
    if (own == identity) {
      return absl::PermissionDeniedError("the file is one of moesnapd's own (its pool or journal)");
    }
  }
  if (info.st_size <= 0 || static_cast<uint64_t>(info.st_size) > kMaxBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the file holds ", info.st_size,
                                                   " bytes; 1 to ", kMaxBytes, " are accepted"));
  }
  const auto bytes = static_cast<uint64_t>(info.st_size);
  struct statfs file_system {};
  const bool huge_pages = fstatfs(fd, &file_system) == 0 &&
                          static_cast<uint64_t>(file_system.f_type) == HUGETLBFS_MAGIC;
  const uint64_t huge_page_bytes = huge_pages ? static_cast<uint64_t>(info.st_blksize) : 0;
  const int seals = fcntl(fd, F_GET_SEALS);
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (data == MAP_FAILED) {
    // Out of address space or mappings is the daemon's condition, not a bad file.
    const std::string why = absl::StrCat("cannot map the file's ", bytes, " bytes: ",
                                         std::strerror(errno));
    return errno == ENOMEM ? absl::ResourceExhaustedError(why) : absl::InvalidArgumentError(why);
  }
  const bool shrink_sealed = seals >= 0 && (seals & F_SEAL_SHRINK) != 0;
  const bool fixed_size = shrink_sealed && (seals & F_SEAL_GROW) != 0;
  // Without a descriptor (the daemon's limit reached) the file is simply not handed on.
  const int kept_fd = keep_descriptor && fixed_size && bytes >= kMinKeptBytes
                          ? fcntl(fd, F_DUPFD_CLOEXEC, 0)
                          : -1;
  return std::shared_ptr<TrainerMemory>(new TrainerMemory(
      static_cast<uint8_t*>(data), bytes, huge_page_bytes, shrink_sealed, info.st_uid, kept_fd));
}

TrainerMemory::~TrainerMemory() {
  munmap(data_, bytes_);
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<TrainerSessions::Session> TrainerSessions::Start(uint32_t rank,
                                                                const Caller& caller) {
  std::string token(16, '\0');
  for (size_t filled = 0; filled < token.size();) {
    const ssize_t got = getrandom(token.data() + filled, token.size() - filled, 0);
    if (got > 0) filled += static_cast<size_t>(got);
  }
  const absl::Time now = absl::Now();
  std::vector<Kept> released;  // unmapped after the lock is released
  absl::MutexLock lock(&mutex_);
  if (auto previous = current_.find(rank); previous != current_.end()) {
    State& holder = sessions_.at(previous->second);
    if (MayBeLive(holder, now) && holder.caller.uid != caller.uid && caller.uid != 0) {
      return absl::PermissionDeniedError(absl::StrCat(
          "rank ", rank, " is held by a live trainer of uid ", holder.caller.uid, " (pid ",
          holder.caller.pid, "); uid ", caller.uid, " (pid ", caller.pid,
          ") may take the rank once that trainer disconnects"));
    }
    RetireLocked(previous->second, holder, released);
    sessions_.erase(previous->second);
  }
  std::vector<std::pair<uint32_t, uint64_t>> abandoned;
  if (sessions_.size() >= kMaxSessions) {
    for (auto session = sessions_.begin(); session != sessions_.end();) {
      if (MayBeLive(session->second, now)) {
        ++session;
        continue;
      }
      abandoned.emplace_back(session->second.rank, session->second.number);
      current_.erase(session->second.rank);
      session = sessions_.erase(session);
    }
    if (sessions_.size() >= kMaxSessions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          sessions_.size(), " trainer sessions are live; a daemon serves at most ", kMaxSessions));
    }
  }
  const uint64_t number = next_session_++;
  State& session = sessions_[token];
  session.rank = rank;
  session.number = number;
  session.caller = caller;
  session.started = now;
  current_[rank] = token;
  return Session{number, token, std::move(abandoned)};
}

bool TrainerSessions::MayBeLive(const State& session, absl::Time now) const {
  return session.connected || session.bound || now - session.started < connection_grace_;
}

absl::StatusOr<uint32_t> TrainerSessions::RankOf(const std::string& token) const {
  absl::MutexLock lock(&mutex_);
  auto session = sessions_.find(token);
  if (session == sessions_.end()) {
    return absl::NotFoundError("the session presented is not current (its trainer disconnected, a "
                               "newer Hello of its rank replaced it, or the daemon restarted): "
                               "call Hello again");
  }
  return session->second.rank;
}

absl::StatusOr<TrainerSessions::State*> TrainerSessions::FindLocked(const std::string& token) {
  auto session = sessions_.find(token);
  if (session == sessions_.end()) {
    return absl::NotFoundError("no current session has this token (a newer Hello of the rank "
                               "replaced it, or the daemon restarted): connect again");
  }
  return &session->second;
}

absl::StatusOr<uint64_t> TrainerSessions::AddLocked(
    State& session, std::vector<std::shared_ptr<TrainerMemory>> memories) {
  if (memories.size() > kMaxMemoriesPerSession - session.memories.size()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "rank ", session.rank, " handed over ", session.memories.size(),
        " files already; a session holds at most ", kMaxMemoriesPerSession));
  }
  const uint64_t first = next_memory_;
  session.connected = true;
  for (std::shared_ptr<TrainerMemory>& memory : memories) {
    session.memories[next_memory_++] = std::move(memory);
  }
  return first;
}

absl::StatusOr<uint64_t> TrainerSessions::Add(
    const std::string& token, std::vector<std::shared_ptr<TrainerMemory>> memories) {
  absl::MutexLock lock(&mutex_);
  absl::StatusOr<State*> session = FindLocked(token);
  if (!session.ok()) return session.status();
  return AddLocked(**session, std::move(memories));
}

absl::StatusOr<std::shared_ptr<TrainerMemory>> TrainerSessions::Find(uint32_t rank,
                                                                     uint64_t id) const {
  absl::MutexLock lock(&mutex_);
  auto current = current_.find(rank);
  if (current != current_.end()) {
    const State& session = sessions_.at(current->second);
    if (auto memory = session.memories.find(id); memory != session.memories.end()) {
      return memory->second;
    }
  }
  return absl::NotFoundError(absl::StrCat("rank ", rank, " handed over no memory ", id,
                                          " in its current session"));
}

absl::Status TrainerSessions::Bind(const std::string& token, ProcessExit process) {
  absl::MutexLock lock(&mutex_);
  absl::StatusOr<State*> session = FindLocked(token);
  if (!session.ok()) return session.status();
  if ((*session)->bound) {
    return absl::FailedPreconditionError(
        "the session's memory connection is open already: a session has one");
  }
  (*session)->bound = true;
  (*session)->process = std::move(process);
  return absl::OkStatus();
}

uint64_t TrainerSessions::RetireLocked(const std::string& token, State& session,
                                       std::vector<Kept>& released) {
  if (!keeps_exited_memory() || !session.process.watching()) return 0;
  Kept kept;
  kept.token = token;
  kept.until = absl::Now() + retention_;
  kept.process = std::move(session.process);
  kept.connection_open = session.bound;
  for (auto& [id, memory] : session.memories) {
    if (memory->kept_fd() >= 0) kept.memories.push_back(std::move(memory));
  }
  std::sort(kept.memories.begin(), kept.memories.end(),
            [](const auto& a, const auto& b) { return a->bytes() > b->bytes(); });
  if (kept.memories.size() > kMaxKeptFilesPerRank) kept.memories.resize(kMaxKeptFilesPerRank);
  // Its largest files that cannot fit the bound even alone go at once.
  uint64_t kept_bytes = 0;
  for (auto memory = kept.memories.begin(); memory != kept.memories.end();) {
    if ((*memory)->bytes() > max_kept_bytes_ - kept_bytes) {
      bound_released_bytes_ += (*memory)->bytes();
      memory = kept.memories.erase(memory);
    } else {
      kept_bytes += (*memory)->bytes();
      ++memory;
    }
  }
  if (kept.memories.empty()) return 0;
  // What the rank kept from an earlier process goes: its next process takes this one's.
  if (auto previous = kept_.find(session.rank); previous != kept_.end()) {
    released.push_back(std::move(previous->second));
    kept_.erase(previous);
  }
  // Room for the rest: the memory kept longest goes first.
  uint64_t others = 0;
  for (const auto& [rank, earlier] : kept_) {
    for (const auto& memory : earlier.memories) others += memory->bytes();
  }
  while (others > max_kept_bytes_ - kept_bytes) {
    auto oldest = std::min_element(kept_.begin(), kept_.end(), [](const auto& a, const auto& b) {
      return a.second.until < b.second.until;
    });
    for (const auto& memory : oldest->second.memories) {
      others -= memory->bytes();
      bound_released_bytes_ += memory->bytes();
    }
    released.push_back(std::move(oldest->second));
    kept_.erase(oldest);
  }
  kept_[session.rank] = std::move(kept);
  return kept_bytes;
}

std::optional<TrainerSessions::Ended> TrainerSessions::End(const std::string& token) {
  std::vector<Kept> released;  // unmapped after the lock is released
  absl::MutexLock lock(&mutex_);
  auto session = sessions_.find(token);
  if (session == sessions_.end()) {
    // A session a newer Hello replaced: its memory, kept, may be handed on now.
    for (auto& [rank, kept] : kept_) {
      if (kept.token == token) kept.connection_open = false;
    }
    return std::nullopt;
  }
  State& state = session->second;
  state.bound = false;
  const Ended ended{.rank = state.rank, .number = state.number,
                    .kept_bytes = RetireLocked(token, state, released)};
  current_.erase(ended.rank);
  sessions_.erase(session);
  return ended;
}

absl::StatusOr<TrainerSessions::Adopted> TrainerSessions::Adopt(const std::string& token,
                                                                uint64_t bytes, uid_t caller,
                                                                bool copying) {
  absl::MutexLock lock(&mutex_);
  absl::StatusOr<State*> session = FindLocked(token);
  if (!session.ok()) return session.status();
  State& state = **session;
  auto kept = kept_.find(state.rank);
  if (kept == kept_.end()) {
    return absl::NotFoundError(
        absl::StrCat("rank ", state.rank, " keeps no memory of an earlier process"));
  }
  if (!kept->second.process.Exited()) {
    return absl::NotFoundError(absl::StrCat(
        "the earlier process of rank ", state.rank, " (pid ", kept->second.process.pid(),
        ") has not exited, so its memory is not handed on"));
  }
  if (kept->second.connection_open) {
    return absl::NotFoundError(absl::StrCat(
        "the memory connection of rank ", state.rank, "'s earlier process is still open (a "
        "process that inherited it, such as a forked worker, still runs)"));
  }
  // No copy of the earlier process can start any more (its session is over), so none in flight
  // now means none ever will touch the file again.
  if (copying) {
    return absl::NotFoundError(absl::StrCat("a capture or restore of rank ", state.rank,
                                            "'s memory is still in flight"));
  }
  std::vector<std::shared_ptr<TrainerMemory>>& memories = kept->second.memories;
  auto fits = std::find_if(memories.begin(), memories.end(), [&](const auto& memory) {
    return memory->bytes() == memory_handoff::FileBytesFor(bytes, memory->huge_page_bytes()) &&
           memory->owner() == caller;
  });
  if (fits == memories.end()) {
    return absl::NotFoundError(absl::StrCat("rank ", state.rank, " keeps ", memories.size(),
                                            " file(s) of its earlier process, none of ", bytes,
                                            " bytes owned by uid ", caller));
  }
  absl::StatusOr<uint64_t> id = AddLocked(state, {*fits});
  if (!id.ok()) return id.status();
  Adopted adopted{.id = *id, .memory = std::move(*fits)};
  memories.erase(fits);
  if (memories.empty()) kept_.erase(kept);
  adopted_bytes_ += adopted.memory->bytes();
  return adopted;
}

void TrainerSessions::ExpireKept(uint32_t rank) {
  absl::MutexLock lock(&mutex_);
  if (auto kept = kept_.find(rank); kept != kept_.end()) kept->second.until = absl::Now();
}

absl::Time TrainerSessions::ReleaseExpired(absl::Time now) {
  std::vector<Kept> expired;  // unmapped after the lock is released
  absl::MutexLock lock(&mutex_);
  absl::Time next = absl::InfiniteFuture();
  for (auto kept = kept_.begin(); kept != kept_.end();) {
    if (kept->second.until <= now) {
      expired.push_back(std::move(kept->second));
      kept = kept_.erase(kept);
    } else {
      next = std::min(next, kept->second.until);
      ++kept;
    }
  }
  return next;
}

TrainerSessions::Retention TrainerSessions::retention() const {
  absl::MutexLock lock(&mutex_);
  Retention retention{.adopted_bytes_total = adopted_bytes_,
                      .bound_released_bytes_total = bound_released_bytes_};
  for (const auto& [rank, kept] : kept_) {
    for (const std::shared_ptr<TrainerMemory>& memory : kept.memories) {
      retention.kept_bytes += memory->bytes();
      ++retention.kept_files;
    }
  }
  return retention;
}

TrainerSessions::Shared TrainerSessions::shared() const {
  absl::MutexLock lock(&mutex_);
  Shared shared;
  for (const auto& [token, session] : sessions_) {
    for (const auto& [id, memory] : session.memories) {
      (memory->huge_page_bytes() > 0 ? shared.huge_page_bytes : shared.ordinary_bytes) +=
          memory->bytes();
    }
  }
  return shared;
}

}  // namespace moesnap::daemon
