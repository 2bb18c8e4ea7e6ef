// DurableDirectory: folder names, listing, atomic publication and removal.
#include "daemon/durable/durable_directory.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace moesnap::daemon::durable {
namespace {

constexpr char kStepPrefix[] = "step-";
constexpr char kPartialPrefix[] = ".partial-step-";
constexpr char kDeletingPrefix[] = ".deleting-step-";

absl::Status FilesystemStatus(const std::error_code& error, const std::string& what) {
  return ErrnoStatus(error.value(), what);
}

}  // namespace

absl::Status ErrnoStatus(int error, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOENT:
      return absl::NotFoundError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status SyncDirectory(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path, " to sync it"));
  const int result = fsync(fd);
  const int error = errno;
  close(fd);
  if (result != 0) return ErrnoStatus(error, absl::StrCat("syncing ", path));
  return absl::OkStatus();
}

DurableDirectory::DurableDirectory(const std::string& root, uint32_t node_id)
    : path_(absl::StrCat(root, "/node-", node_id)), node_id_(node_id) {}

std::string DurableDirectory::StepPath(int64_t step) const {
  return absl::StrCat(path_, "/", kStepPrefix, step);
}

std::string DurableDirectory::PartialPath(int64_t step) const {
  return absl::StrCat(path_, "/", kPartialPrefix, step);
}

absl::Status DurableDirectory::Create() const {
  std::error_code error;
  std::filesystem::create_directories(path_, error);
  if (error) return FilesystemStatus(error, absl::StrCat("creating ", path_));
  if (chmod(path_.c_str(), 0700) != 0) {
    return ErrnoStatus(errno, absl::StrCat("setting the mode of ", path_));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> DurableDirectory::RemoveLeftovers() const {
  std::error_code error;
  int removed = 0;
  std::vector<std::filesystem::path> leftovers;
  for (std::filesystem::directory_iterator it(path_, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (absl::StartsWith(name, kPartialPrefix) || absl::StartsWith(name, kDeletingPrefix)) {
      leftovers.push_back(it->path());
    }
  }
  if (error) return FilesystemStatus(error, absl::StrCat("listing ", path_));
  for (const std::filesystem::path& leftover : leftovers) {
    std::filesystem::remove_all(leftover, error);
    if (error) return FilesystemStatus(error, absl::StrCat("removing ", leftover.string()));
    ++removed;
  }
  return removed;
}

absl::StatusOr<std::vector<int64_t>> DurableDirectory::Steps() const {
  std::error_code error;
  std::vector<int64_t> steps;
  for (std::filesystem::directory_iterator it(path_, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    int64_t step = 0;
    if (absl::StartsWith(name, kStepPrefix) &&
        absl::SimpleAtoi(name.substr(sizeof(kStepPrefix) - 1), &step) &&
        name == absl::StrCat(kStepPrefix, step) && it->is_directory(error)) {
      steps.push_back(step);
    }
  }
  if (error) return FilesystemStatus(error, absl::StrCat("listing ", path_));
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::StatusOr<std::string> DurableDirectory::CreatePartial(int64_t step) const {
  const std::string partial = PartialPath(step);
  std::error_code error;
  std::filesystem::remove_all(partial, error);
  if (error) return FilesystemStatus(error, absl::StrCat("removing ", partial));
  if (mkdir(partial.c_str(), 0700) != 0) {
    return ErrnoStatus(errno, absl::StrCat("creating ", partial));
  }
  return partial;
}

absl::Status DurableDirectory::Publish(int64_t step) const {
  const std::string partial = PartialPath(step);
  const std::string complete = StepPath(step);
  if (absl::Status status = SyncDirectory(partial); !status.ok()) return status;
  if (renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, complete.c_str(), RENAME_NOREPLACE) != 0) {
    if (errno != EEXIST) {
      return ErrnoStatus(errno, absl::StrCat("renaming ", partial, " to ", complete));
    }
    // A complete folder of this step from an abandoned run: swap atomically, then delete it.
    if (renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, complete.c_str(), RENAME_EXCHANGE) != 0) {
      return ErrnoStatus(errno, absl::StrCat("exchanging ", partial, " and ", complete));
    }
    std::error_code error;
    std::filesystem::remove_all(partial, error);
  }
  return SyncDirectory(path_);
}

void DurableDirectory::Discard(int64_t step) const {
  std::error_code error;
  std::filesystem::remove_all(PartialPath(step), error);
}

absl::Status DurableDirectory::Remove(int64_t step) const {
  const std::string deleting = absl::StrCat(path_, "/", kDeletingPrefix, step);
  if (rename(StepPath(step).c_str(), deleting.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("renaming ", StepPath(step), " to ", deleting));
  }
  std::error_code error;
  std::filesystem::remove_all(deleting, error);
  if (error) return FilesystemStatus(error, absl::StrCat("removing ", deleting));
  return SyncDirectory(path_);
}

absl::StatusOr<uint64_t> DurableDirectory::StepBytes(int64_t step) const {
  std::error_code error;
  uint64_t bytes = 0;
  for (std::filesystem::directory_iterator it(StepPath(step), error), end; !error && it != end;
       it.increment(error)) {
    struct stat info {};
    if (lstat(it->path().c_str(), &info) == 0 && S_ISREG(info.st_mode)) {
      bytes += static_cast<uint64_t>(info.st_size);
    }
  }
  if (error) return FilesystemStatus(error, absl::StrCat("listing ", StepPath(step)));
  return bytes;
}

}  // namespace moesnap::daemon::durable
