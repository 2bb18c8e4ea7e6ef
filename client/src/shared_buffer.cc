// SharedBuffer over memfd_create: reserved, sealed against resizing, mapped with its page tables
// filled (first-touch faults cost about 10 us each on virtual machines; where the hypervisor
// shadows the guest's page tables, the first access to each page still costs about half of that),
// in huge pages (MFD_HUGETLB) where asked for and to be had.
#include "moesnap/shared_buffer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/memory_handoff_wire.h"

namespace moesnap {
namespace {

absl::StatusOr<SharedBuffer::Pages> PagesAsked(SharedBuffer::Pages pages) {
  if (pages != SharedBuffer::Pages::kFromEnvironment) return pages;
  const char* value = std::getenv(SharedBuffer::kHugePagesVariable);
  const std::string_view asked = value == nullptr ? "" : value;
  if (asked.empty() || asked == "0") return SharedBuffer::Pages::kOrdinary;
  if (asked == "1") return SharedBuffer::Pages::kHuge;
  return absl::InvalidArgumentError(
      absl::StrCat(SharedBuffer::kHugePagesVariable, " is '", std::string(asked),
                   "': 1 puts trainer memory in huge pages where the host has them free, 0 (or "
                   "leaving it unset) in ordinary pages"));
}

// Seals the file's size, so that the daemon reading it does not fault.
bool SealSize(int fd) {
  return fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0;
}

// A sealed file of huge pages holding `bytes`, its pages reserved now; -1 when there is none to be
// had (no huge pages on this kernel, too few free, or rounding would add more than an eighth).
int CreateHugePageFile(size_t bytes, const char* name) {
  const int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
  if (fd < 0) return -1;
  struct stat info {};
  const uint64_t file_bytes =
      fstat(fd, &info) == 0 && info.st_blksize > 0
          ? memory_handoff::FileBytesFor(bytes, static_cast<uint64_t>(info.st_blksize))
          : 0;
  const bool worth_it = file_bytes != 0 && file_bytes - bytes <= bytes / 8 &&
                        file_bytes <= static_cast<uint64_t>(INT64_MAX);
  // posix_fallocate takes the pages from the reserved pool now: ENOSPC when too few are free.
  if (!worth_it || ftruncate(fd, static_cast<off_t>(file_bytes)) != 0 ||
      posix_fallocate(fd, 0, static_cast<off_t>(file_bytes)) != 0 || !SealSize(fd)) {
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

struct SharedBuffer::State {
  int fd = -1;
  uint8_t* data = nullptr;
  size_t bytes = 0;
  size_t file_bytes = 0;  // mapped, and unmapped, whole: huge pages unmap in whole pages only
  size_t page_bytes = 0;
};

SharedBuffer::SharedBuffer(std::unique_ptr<State> state) : state_(std::move(state)) {}

SharedBuffer::~SharedBuffer() {
  munmap(state_->data, state_->file_bytes);
  close(state_->fd);
}

absl::StatusOr<int> SharedBuffer::CreateFile(size_t bytes, const char* name, Pages pages) {
  if (bytes == 0) return absl::InvalidArgumentError("a shared buffer needs at least 1 byte");
  absl::StatusOr<Pages> asked = PagesAsked(pages);
  if (!asked.ok()) return asked.status();
  if (*asked == Pages::kHuge) {
    if (const int fd = CreateHugePageFile(bytes, name); fd >= 0) return fd;
  }
  const int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  }
  auto fail = [fd](const std::string& what, int error) {
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat(what, ": ", std::strerror(error)));
  };
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return fail(absl::StrCat("cannot size a shared buffer to ", bytes, " bytes"), errno);
  }
  if (int error = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0) {
    return fail(absl::StrCat("cannot reserve ", bytes, " bytes of shared memory"), error);
  }
  if (!SealSize(fd)) return fail("cannot seal a shared buffer's size", errno);
  return fd;
}

absl::StatusOr<std::shared_ptr<SharedBuffer>> SharedBuffer::Allocate(size_t bytes,
                                                                    const char* name,
                                                                    Pages pages) {
  absl::StatusOr<int> fd = CreateFile(bytes, name, pages);
  if (!fd.ok()) return fd.status();
  absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = Map(*fd, bytes);
  if (!buffer.ok()) close(*fd);
  return buffer;
}

absl::StatusOr<std::shared_ptr<SharedBuffer>> SharedBuffer::Map(int fd, size_t bytes) {
  struct stat info {};
  if (fstat(fd, &info) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot stat a shared-memory file: ", std::strerror(errno)));
  }
  const auto file_bytes = static_cast<size_t>(info.st_size);
  if (bytes == 0 || file_bytes < bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a shared-memory file of ", file_bytes,
                                                   " bytes cannot hold ", bytes));
  }
  void* data =
      mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (data == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", file_bytes, " shared bytes: ", std::strerror(errno)));
  }
  return std::shared_ptr<SharedBuffer>(new SharedBuffer(
      std::make_unique<State>(State{fd, static_cast<uint8_t*>(data), bytes, file_bytes,
                                    static_cast<size_t>(info.st_blksize)})));
}

uint8_t* SharedBuffer::data() const { return state_->data; }
size_t SharedBuffer::size() const { return state_->bytes; }
size_t SharedBuffer::file_bytes() const { return state_->file_bytes; }
size_t SharedBuffer::page_bytes() const { return state_->page_bytes; }
int SharedBuffer::fd() const { return state_->fd; }

}  // namespace moesnap
