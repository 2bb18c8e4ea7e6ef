// Throughput measurement shared by every suite. A figure and its baseline are measured in
// interleaved repetitions (figure, baseline, figure, ...) and the best repetition of each is kept,
// so that a burst of load from elsewhere on the machine hits both alike instead of skewing the ratio.
#ifndef MOESNAP_BENCH_TIMING_H_
#define MOESNAP_BENCH_TIMING_H_

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>

namespace moesnap::bench {

struct TimingOptions {
  double min_seconds_per_repetition = 0.2;
  int repetitions = 5;
};

struct Comparison {
  double value = 0;     // GB/s (1e9 bytes per second) of the measured code
  double baseline = 0;  // GB/s of the baseline
};

namespace internal {
// One repetition: calls `body` until the minimum time has passed; returns GB/s.
inline double TimedRepetition(const std::function<void()>& body, size_t bytes_per_call,
                              double min_seconds) {
  using Clock = std::chrono::steady_clock;
  size_t calls = 0;
  const Clock::time_point start = Clock::now();
  double elapsed = 0;
  do {
    body();
    ++calls;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < min_seconds);
  return static_cast<double>(bytes_per_call) * calls / elapsed / 1e9;
}
}  // namespace internal

// Both bodies process `bytes_per_call` bytes per call. Each is called once first to warm caches,
// page in buffers and build lazily cached tables.
inline Comparison CompareGigabytesPerSecond(const std::function<void()>& measured,
                                            const std::function<void()>& baseline,
                                            size_t bytes_per_call,
                                            const TimingOptions& options = {}) {
  measured();
  baseline();
  Comparison best;
  for (int repetition = 0; repetition < options.repetitions; ++repetition) {
    best.value = std::max(best.value, internal::TimedRepetition(
                                          measured, bytes_per_call,
                                          options.min_seconds_per_repetition));
    best.baseline = std::max(best.baseline, internal::TimedRepetition(
                                                baseline, bytes_per_call,
                                                options.min_seconds_per_repetition));
  }
  return best;
}

}  // namespace moesnap::bench

#endif  // MOESNAP_BENCH_TIMING_H_
