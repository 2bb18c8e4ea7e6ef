// A snapshot pool for a unit test: its own file in /dev/shm, unlocked, removed with the object.
// The pool must outlive everything allocated from it, so declare it before them.
#ifndef MOESNAP_TESTS_TESTING_TEST_POOL_H_
#define MOESNAP_TESTS_TESTING_TEST_POOL_H_

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "daemon/pool.h"

namespace moesnap::testing {

class TestPool {
 public:
  explicit TestPool(uint64_t bytes = 16 << 20) {
    static std::atomic<int> counter{0};
    options_.name =
        "moesnap-test-pool-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    options_.bytes = bytes;
    options_.lock = daemon::PoolLockMode::kOff;
    pool_ = *daemon::Pool::OpenOrCreate(options_);  // dies naming the error if it cannot
  }
  ~TestPool() {
    pool_.reset();
    std::remove(("/dev/shm/" + options_.name + ".data").c_str());
  }
  TestPool(const TestPool&) = delete;
  TestPool& operator=(const TestPool&) = delete;

  daemon::Pool* get() const { return pool_.get(); }

 private:
  daemon::PoolOptions options_;
  std::unique_ptr<daemon::Pool> pool_;
};

}  // namespace moesnap::testing

#endif  // MOESNAP_TESTS_TESTING_TEST_POOL_H_
