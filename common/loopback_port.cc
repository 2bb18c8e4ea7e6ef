// UnusedLoopbackPort: draw a port below the ephemeral range, keep it if it binds now and this
// process has not handed it out before.
#include "common/loopback_port.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <random>
#include <set>

#include "absl/synchronization/mutex.h"

namespace moesnap {
namespace {

// Ports from here up to the ephemeral range are drawn from: above the usual services' ports.
constexpr uint16_t kLowestPort = 15000;
constexpr int kFewestPorts = 1000;

// The first port the kernel hands out by itself; 32768, Linux's default, if unreadable.
int EphemeralRangeStart() {
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  int first = 0;
  return range >> first && first > 0 ? first : 32768;
}

// Binds a TCP socket to 127.0.0.1:`port` (0: the kernel chooses) and closes it; the port bound,
// or 0 if it could not be.
uint16_t BindAndRelease(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  socklen_t length = sizeof(address);
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                     getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  close(fd);
  return bound ? ntohs(address.sin_port) : 0;
}

}  // namespace

uint16_t UnusedLoopbackPort() {
  static absl::Mutex mutex(absl::kConstInit);
  static std::set<uint16_t>* handed_out = new std::set<uint16_t>();
  static std::mt19937* random = new std::mt19937(std::random_device{}());
  absl::MutexLock lock(&mutex);
  const int end = EphemeralRangeStart();
  for (int attempt = 0; attempt < 100; ++attempt) {
    // A machine whose ephemeral range leaves too few ports below it: the kernel's choice.
    std::uniform_int_distribution<int> below_ephemeral(kLowestPort, end - 1);
    const uint16_t port = end - kLowestPort < kFewestPorts
                              ? BindAndRelease(0)
                              : static_cast<uint16_t>(below_ephemeral(*random));
    if (port == 0) return 0;
    if (!handed_out->contains(port) && BindAndRelease(port) == port) {
      handed_out->insert(port);
      return port;
    }
  }
  return 0;
}

}  // namespace moesnap
