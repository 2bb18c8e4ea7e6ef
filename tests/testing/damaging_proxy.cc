#include "tests/testing/damaging_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>

namespace moesnap::testing {
namespace {

constexpr int kPollMs = 100;  // how often the acceptor looks whether to stop

sockaddr_in Loopback(uint16_t port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

bool WriteAll(int fd, const uint8_t* data, size_t size) {
  while (size > 0) {
    const ssize_t written = send(fd, data, size, MSG_NOSIGNAL);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) return false;
    data += written;
    size -= static_cast<size_t>(written);
  }
  return true;
}

}  // namespace

DamagingProxy::DamagingProxy(uint16_t target_port, uint64_t at, int damages)
    : target_port_(target_port), at_(at), damages_(damages) {
  listener_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address = Loopback(0);
  socklen_t length = sizeof(address);
  if (listener_ < 0 || bind(listener_, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      listen(listener_, 64) != 0 ||
      getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (listener_ >= 0) close(listener_);
    throw std::runtime_error("the damaging proxy cannot listen on 127.0.0.1");
  }
  port_ = ntohs(address.sin_port);
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

DamagingProxy::~DamagingProxy() {
  stopping_ = true;
  acceptor_.join();
  std::vector<std::thread> connections;
  std::vector<int> sockets;
  {
    absl::MutexLock lock(&mutex_);
    for (int fd : open_) shutdown(fd, SHUT_RDWR);
    connections.swap(connections_);
    sockets.swap(open_);
  }
  for (std::thread& connection : connections) connection.join();
  for (int fd : sockets) close(fd);
  close(listener_);
}

void DamagingProxy::AcceptLoop() {
  while (!stopping_) {
    pollfd ready{listener_, POLLIN, 0};
    if (poll(&ready, 1, kPollMs) <= 0) continue;
    const int client = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) {
      // Out of descriptors or memory, the connection stays queued and the listener readable: back
      // off instead of spinning on it.
      if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) poll(nullptr, 0, kPollMs);
      continue;
    }
    const int target = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const sockaddr_in address = Loopback(target_port_);
    if (target < 0 ||
        connect(target, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
      if (target >= 0) close(target);
      close(client);
      continue;
    }
    absl::MutexLock lock(&mutex_);
    open_.push_back(client);
    open_.push_back(target);
    connections_.emplace_back([this, client, target] { Pump(client, target, /*damage=*/true); });
    connections_.emplace_back([this, client, target] { Pump(target, client, /*damage=*/false); });
  }
}

void DamagingProxy::Pump(int from, int to, bool damage) {
  std::vector<uint8_t> buffer(64 << 10);
  uint64_t offset = 0;  // of what was read from `from`
  while (true) {
    const ssize_t got = recv(from, buffer.data(), buffer.size(), 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    const uint64_t end = offset + static_cast<uint64_t>(got);
    if (damage && at_ >= offset && at_ < end) {
      int seen = damaged_.load();
      while (seen < damages_ && !damaged_.compare_exchange_weak(seen, seen + 1)) {
      }
      if (seen < damages_) buffer[at_ - offset] ^= 0xff;
    }
    offset = end;
    if (!WriteAll(to, buffer.data(), static_cast<size_t>(got))) break;
  }
  // Either end gone: both directions end, and the other pump's read returns.
  shutdown(from, SHUT_RDWR);
  shutdown(to, SHUT_RDWR);
}

}  // namespace moesnap::testing
