// UnusedLoopbackPort: bind to port 0, read the port the kernel chose, close.
#include "common/loopback_port.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace moesnap {

uint16_t UnusedLoopbackPort() {
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

}  // namespace moesnap
