// SharedMemory over shm_open/mmap.
#include "common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moesnap {
namespace {

std::string ShmPath(const std::string& name) { return absl::StrCat("/", name); }

absl::Status ErrnoStatus(int error, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case ENOENT: return absl::NotFoundError(message);
    case EEXIST: return absl::AlreadyExistsError(message);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(message);
    case ENOSPC:
    case ENOMEM: return absl::ResourceExhaustedError(message);
    case EINVAL:
    case ENAMETOOLONG: return absl::InvalidArgumentError(message);
    default: return absl::InternalError(message);
  }
}

absl::Status CheckName(const std::string& name) {
  if (name.empty() || name.find('/') != std::string::npos || name.size() > 200) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory name '", name, "' must be 1-200 characters without '/'"));
  }
  return absl::OkStatus();
}

// A file another user created (squatting the name before the daemon) or could read or write is
// never adopted: its bytes are not the daemon's.
absl::Status CheckOwnFile(const std::string& name, const struct stat& info) {
  const mode_t mode = info.st_mode & 07777;
  if (!S_ISREG(info.st_mode) || info.st_uid != geteuid() || mode != 0600) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "/dev/shm/%s is %s owned by uid %d with mode %04o, but this process (uid %d) adopts only "
        "its own regular files with mode 0600: another user may have created or read it; remove "
        "it (losing what it holds) if it is not this daemon's",
        name, S_ISREG(info.st_mode) ? "a file" : "not a regular file", info.st_uid, mode,
        geteuid()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SharedMemory> SharedMemory::Create(const std::string& name, size_t bytes,
                                                  const CreateOptions& options) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (bytes == 0) return absl::InvalidArgumentError("a shared-memory file needs at least 1 byte");
  const int fd =
      shm_open(ShmPath(name).c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("cannot create /dev/shm/", name));
  auto fail = [&](int error, const std::string& what) {
    close(fd);
    shm_unlink(ShmPath(name).c_str());
    return ErrnoStatus(error, what);
  };
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return fail(errno, absl::StrCat("cannot size /dev/shm/", name, " to ", bytes, " bytes"));
  }
  if (options.reserve) {
    if (int error = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0) {
      return fail(error, absl::StrCat("cannot reserve ", bytes, " bytes for /dev/shm/", name,
                                      " (is /dev/shm large enough?)"));
    }
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (data == MAP_FAILED) return fail(errno, absl::StrCat("cannot map /dev/shm/", name));
  close(fd);
  return SharedMemory(name, static_cast<uint8_t*>(data), bytes);
}

absl::StatusOr<SharedMemory> SharedMemory::Open(const std::string& name, bool writable) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  const int fd =
      shm_open(ShmPath(name).c_str(), (writable ? O_RDWR : O_RDONLY) | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0 && errno == ELOOP) {
    return absl::FailedPreconditionError(absl::StrCat(
        "/dev/shm/", name, " is a symbolic link, not a file this daemon created: remove it"));
  }
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("cannot open /dev/shm/", name));
  struct stat info {};
  if (fstat(fd, &info) != 0) {
    const int error = errno;
    close(fd);
    return ErrnoStatus(error, absl::StrCat("cannot stat /dev/shm/", name));
  }
  if (absl::Status own = CheckOwnFile(name, info); !own.ok()) {
    close(fd);
    return own;
  }
  if (info.st_size == 0) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat("/dev/shm/", name, " is empty"));
  }
  const size_t bytes = static_cast<size_t>(info.st_size);
  void* data = mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                    MAP_SHARED | MAP_POPULATE, fd, 0);
  const int error = errno;
  close(fd);
  if (data == MAP_FAILED) return ErrnoStatus(error, absl::StrCat("cannot map /dev/shm/", name));
  return SharedMemory(name, static_cast<uint8_t*>(data), bytes);
}

absl::Status SharedMemory::Unlink(const std::string& name) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (shm_unlink(ShmPath(name).c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("cannot unlink /dev/shm/", name));
  }
  return absl::OkStatus();
}

bool SharedMemory::Exists(const std::string& name) {
  struct stat info {};
  return CheckName(name).ok() && stat(absl::StrCat("/dev/shm/", name).c_str(), &info) == 0;
}

SharedMemory::SharedMemory(SharedMemory&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

SharedMemory& SharedMemory::operator=(SharedMemory&& other) noexcept {
  if (this != &other) {
    Release();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

SharedMemory::~SharedMemory() { Release(); }

void SharedMemory::Release() {
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace moesnap
