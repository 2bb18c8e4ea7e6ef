// TrainerMemory: fstat, seal check and one MAP_POPULATE mapping per file; TrainerSessions: tokens
// from the system's random source, memory ids unique across sessions.
#include "daemon/trainer_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

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
    int fd, uid_t owner, const std::vector<FileIdentity>& refused) {
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
  const int seals = fcntl(fd, F_GET_SEALS);
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (data == MAP_FAILED) {
    return absl::InvalidArgumentError(absl::StrCat("cannot map the file's ", bytes, " bytes: ",
                                                   std::strerror(errno)));
  }
  return std::shared_ptr<TrainerMemory>(new TrainerMemory(
      static_cast<uint8_t*>(data), bytes, seals >= 0 && (seals & F_SEAL_SHRINK) != 0));
}

TrainerMemory::~TrainerMemory() { munmap(data_, bytes_); }

absl::StatusOr<TrainerSessions::Session> TrainerSessions::Start(uint32_t rank,
                                                                const Caller& caller) {
  std::string token(16, '\0');
  for (size_t filled = 0; filled < token.size();) {
    const ssize_t got = getrandom(token.data() + filled, token.size() - filled, 0);
    if (got > 0) filled += static_cast<size_t>(got);
  }
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mutex_);
  if (auto previous = current_.find(rank); previous != current_.end()) {
    const State& holder = sessions_.at(previous->second);
    const bool live = holder.connected || now - holder.started < kMemoryConnectionGrace;
    if (live && holder.caller.uid != caller.uid && caller.uid != 0) {
      return absl::PermissionDeniedError(absl::StrCat(
          "rank ", rank, " is held by a live trainer of uid ", holder.caller.uid, " (pid ",
          holder.caller.pid, "); uid ", caller.uid, " (pid ", caller.pid,
          ") may take the rank once that trainer disconnects"));
    }
    sessions_.erase(previous->second);
  }
  const uint64_t number = next_session_++;
  sessions_[token] = State{.rank = rank, .number = number, .caller = caller, .started = now};
  current_[rank] = token;
  return Session{number, token};
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

absl::StatusOr<uint64_t> TrainerSessions::Add(
    const std::string& token, std::vector<std::shared_ptr<TrainerMemory>> memories) {
  absl::MutexLock lock(&mutex_);
  auto session = sessions_.find(token);
  if (session == sessions_.end()) {
    return absl::NotFoundError("no current session has this token (a newer Hello of the rank "
                               "replaced it, or the daemon restarted): connect again");
  }
  if (memories.size() > kMaxMemoriesPerSession - session->second.memories.size()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "rank ", session->second.rank, " handed over ", session->second.memories.size(),
        " files already; a session holds at most ", kMaxMemoriesPerSession));
  }
  const uint64_t first = next_memory_;
  session->second.connected = true;
  for (std::shared_ptr<TrainerMemory>& memory : memories) {
    session->second.memories[next_memory_++] = std::move(memory);
  }
  return first;
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

std::optional<std::pair<uint32_t, uint64_t>> TrainerSessions::End(const std::string& token) {
  absl::MutexLock lock(&mutex_);
  auto session = sessions_.find(token);
  if (session == sessions_.end()) return std::nullopt;
  const std::pair<uint32_t, uint64_t> ended{session->second.rank, session->second.number};
  current_.erase(ended.first);
  sessions_.erase(session);
  return ended;
}

}  // namespace moesnap::daemon
