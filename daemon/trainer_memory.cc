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

namespace moesnap::daemon {

absl::StatusOr<std::shared_ptr<TrainerMemory>> TrainerMemory::Map(int fd) {
  struct stat info {};
  if (fstat(fd, &info) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot stat the file: ", std::strerror(errno)));
  }
  if (!S_ISREG(info.st_mode)) {
    return absl::InvalidArgumentError("the descriptor is not a shared-memory file");
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

TrainerSessions::Session TrainerSessions::Start(uint32_t rank) {
  std::string token(16, '\0');
  for (size_t filled = 0; filled < token.size();) {
    const ssize_t got = getrandom(token.data() + filled, token.size() - filled, 0);
    if (got > 0) filled += static_cast<size_t>(got);
  }
  absl::MutexLock lock(&mutex_);
  if (auto previous = current_.find(rank); previous != current_.end()) {
    sessions_.erase(previous->second);
  }
  const uint64_t number = next_session_++;
  sessions_[token] = State{rank, number, {}};
  current_[rank] = token;
  return {number, token};
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
