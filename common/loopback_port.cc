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

bool Bindable(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  close(fd);
  return bound;
}

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
  static std::mt19937* random = new std::mt19937(std::random_device{}());
  absl::MutexLock lock(&mutex);
  const int end = EphemeralRangeStart();
  for (int attempt = 0; attempt < 100; ++attempt) {
    // A machine whose ephemeral range leaves too few ports below it: the kernel's choice.
    const uint16_t port =
        end - kLowestPort < kFewestPorts
            ? KernelChosenPort()
            : static_cast<uint16_t>(std::uniform_int_distribution<int>(kLowestPort, end - 1)(*random));
    if (port == 0) return 0;
    if (!handed_out->contains(port) && Bindable(port)) {
      handed_out->insert(port);
      return port;
    }
  }
  return 0;
}

}  // namespace moesnap
