// SharedBuffer over memfd_create: reserved, sealed against resizing, mapped with its page tables
// filled (first-touch faults cost about 10 us each on virtual machines; where the hypervisor
// shadows the guest's page tables, the first access to each page still costs about half of that).
#include "moesnap/shared_buffer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moesnap {

struct SharedBuffer::State {
  int fd = -1;
  uint8_t* data = nullptr;
  size_t bytes = 0;
};

SharedBuffer::SharedBuffer(std::unique_ptr<State> state) : state_(std::move(state)) {}

SharedBuffer::~SharedBuffer() {
  munmap(state_->data, state_->bytes);
  close(state_->fd);
}

absl::StatusOr<int> SharedBuffer::CreateFile(size_t bytes, const char* name) {
  if (bytes == 0) return absl::InvalidArgumentError("a shared buffer needs at least 1 byte");
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
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail("cannot seal a shared buffer's size", errno);
  }
  return fd;
}

absl::StatusOr<std::shared_ptr<SharedBuffer>> SharedBuffer::Allocate(size_t bytes,
                                                                    const char* name) {
  absl::StatusOr<int> fd = CreateFile(bytes, name);
  if (!fd.ok()) return fd.status();
  absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = Map(*fd, bytes);
  if (!buffer.ok()) close(*fd);
  return buffer;
}

absl::StatusOr<std::shared_ptr<SharedBuffer>> SharedBuffer::Map(int fd, size_t bytes) {
  void* data = bytes == 0 ? MAP_FAILED
                          : mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_POPULATE, fd, 0);
  if (data == MAP_FAILED) {
    const int error = bytes == 0 ? EINVAL : errno;
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", bytes, " shared bytes: ", std::strerror(error)));
  }
  return std::shared_ptr<SharedBuffer>(
      new SharedBuffer(std::make_unique<State>(State{fd, static_cast<uint8_t*>(data), bytes})));
}

uint8_t* SharedBuffer::data() const { return state_->data; }
size_t SharedBuffer::size() const { return state_->bytes; }
int SharedBuffer::fd() const { return state_->fd; }

}  // namespace moesnap
