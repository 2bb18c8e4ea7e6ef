// UnusedLoopbackPort: bind to port 0, read the port the kernel chose, close; a port this process
// handed out before is skipped, since the kernel may choose it again while its user has yet to bind.
#include "common/loopback_port.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>

#include "absl/synchronization/mutex.h"

namespace moesnap {
namespace {

uint16_t KernelChosenPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  const bool ok = fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  if (fd >= 0) close(fd);
  return ok ? ntohs(address.sin_port) : 0;
}

}  // namespace

uint16_t UnusedLoopbackPort() {
  static absl::Mutex mutex(absl::kConstInit);
  static std::set<uint16_t>* handed_out = new std::set<uint16_t>();
  absl::MutexLock lock(&mutex);
  for (int attempt = 0; attempt < 100; ++attempt) {
    const uint16_t port = KernelChosenPort();
    if (port == 0) return 0;
    if (handed_out->insert(port).second) return port;
  }
  return 0;
}

}  // namespace moesnap
