// A TCP proxy on 127.0.0.1 that damages what passes through it, for tests of data sent over a
// network that corrupts bytes (a flipped bit a frame's checksums must catch). What a client writes
// reaches the target with the byte at stream offset `at` of a connection inverted, in connections
// that reach that offset, until `damages` bytes were inverted; the rest, and every byte the target
// sends back, passes unchanged.
#ifndef MOESNAP_TESTS_TESTING_DAMAGING_PROXY_H_
#define MOESNAP_TESTS_TESTING_DAMAGING_PROXY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace moesnap::testing {

class DamagingProxy {
 public:
  DamagingProxy(uint16_t target_port, uint64_t at, int damages);
  ~DamagingProxy();  // closes every connection
  DamagingProxy(const DamagingProxy&) = delete;
  DamagingProxy& operator=(const DamagingProxy&) = delete;

  // Where clients connect.
  uint16_t port() const { return port_; }
  // Bytes inverted so far.
  int damaged() const { return damaged_; }

 private:
  void AcceptLoop();
  // Copies what `from` sends to `to` until either end closes, damaging it when `damage`.
  void Pump(int from, int to, bool damage);

  const uint16_t target_port_;
  const uint64_t at_;
  const int damages_;
  int listener_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> damaged_{0};
  std::thread acceptor_;
  absl::Mutex mutex_;
  std::vector<std::thread> connections_ ABSL_GUARDED_BY(mutex_);  // two pumps each
  std::vector<int> open_ ABSL_GUARDED_BY(mutex_);  // sockets, closed when the proxy goes
};

}  // namespace moesnap::testing

#endif  // MOESNAP_TESTS_TESTING_DAMAGING_PROXY_H_
