// Metrics in the Prometheus text format: counters, gauges and histograms with fixed buckets that any
// unit registers once and updates on its hot path with one relaxed atomic operation (no lock per
// observation), and collectors that read a unit's existing view (the store's status, the cluster's
// nodes) when a scrape asks. One process-wide registry (Registry::Default()) is what moesnapd
// serves on /metrics; tests build their own.
//
// Registering:  static metrics::Counter& bytes = metrics::Registry::Default().AddCounter(
//                   "moesnap_snapshot_bytes_total", "Bytes trainers asked to snapshot");
//               bytes.Add(n);
// Names follow Prometheus conventions and are checked at registration: counters end in _total,
// units are base units in the name (_bytes, _seconds). Registering the same name and labels again
// returns the same metric; the same name with another type or help is a programming error (abort).
#ifndef MOESNAP_COMMON_METRICS_H_
#define MOESNAP_COMMON_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace moesnap::metrics {

// Label name and value pairs, e.g. {{"outcome", "committed"}}.
using Labels = std::vector<std::pair<std::string, std::string>>;

// Monotonic count. Thread-safe, lock-free.
class Counter {
 public:
  void Add(uint64_t amount = 1) { value_.fetch_add(amount, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// A value that goes up and down. Thread-safe, lock-free.
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double amount) { value_.fetch_add(amount, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Observations counted into fixed buckets (upper bounds, ascending; +Inf is implicit). Observe is
// thread-safe and lock-free: a bucket search over the bounds and two relaxed atomic adds.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);

  void Observe(double value);

  struct Counts {
    std::vector<uint64_t> cumulative;  // per bound, then +Inf (== count)
    uint64_t count = 0;
    double sum = 0;
  };
  // A consistent-enough read for a scrape: each bucket is read once, and count is the +Inf bucket.
  Counts Read() const;
  const std::vector<double>& upper_bounds() const { return upper_bounds_; }

 private:
  std::vector<double> upper_bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // non-cumulative, bounds.size() + 1
  std::atomic<double> sum_{0};
};

// Bucket bounds for durations: 100 us to 100 s, 1-2.5-5 per decade.
std::vector<double> DurationBuckets();
// Bucket bounds for sizes: 4 KiB to 64 GiB, powers of 4.
std::vector<double> ByteBuckets();

// What a collector adds at scrape time. Samples of one family (name) share type and help.
class Collection {
 public:
  void AddGauge(const std::string& name, const std::string& help, double value, Labels labels = {});
  void AddCounter(const std::string& name, const std::string& help, double value, Labels labels = {});

 private:
  friend class Registry;
  struct Sample {
    std::string name, help, type;
    Labels labels;
    double value;
  };
  std::vector<Sample> samples_;
};

class Registry;

// Keeps a collector registered; destroying it removes the collector, waiting for a scrape that is
// calling it to finish, so a collector may capture pointers that die right after its handle.
class CollectorHandle {
 public:
  CollectorHandle() = default;
  CollectorHandle(CollectorHandle&& other) noexcept { *this = std::move(other); }
  CollectorHandle& operator=(CollectorHandle&& other) noexcept;
  ~CollectorHandle();

 private:
  friend class Registry;
  CollectorHandle(Registry* registry, int id) : registry_(registry), id_(id) {}
  Registry* registry_ = nullptr;
  int id_ = 0;
};

// Thread-safe. Metrics live as long as the registry (the default one: the process).
class Registry {
 public:
  static Registry& Default();

  Counter& AddCounter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge& AddGauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram& AddHistogram(const std::string& name, const std::string& help,
                          std::vector<double> upper_bounds, const Labels& labels = {});
  [[nodiscard]] CollectorHandle AddCollector(std::function<void(Collection&)> collect);

  // Every family in the text exposition format 0.0.4, sorted by name, HELP and TYPE first.
  std::string Exposition();

 private:
  friend class CollectorHandle;
  struct Family {
    std::string help;
    std::string type;  // counter, gauge, histogram
    std::map<Labels, std::unique_ptr<Counter>> counters;
    std::map<Labels, std::unique_ptr<Gauge>> gauges;
    std::map<Labels, std::unique_ptr<Histogram>> histograms;
  };
  Family& FamilyFor(const std::string& name, const std::string& help, const std::string& type,
                    const Labels& labels) ABSL_EXCLUSIVE_LOCKS_REQUIRED(metrics_mutex_);
  void RemoveCollector(int id);

  // Two locks, never held together: a unit may register a metric while holding its own lock, and a
  // collector takes that unit's lock during a scrape.
  absl::Mutex metrics_mutex_;
  std::map<std::string, Family> families_ ABSL_GUARDED_BY(metrics_mutex_);
  absl::Mutex collectors_mutex_;
  std::map<int, std::function<void(Collection&)>> collectors_ ABSL_GUARDED_BY(collectors_mutex_);
  int next_collector_ ABSL_GUARDED_BY(collectors_mutex_) = 0;
};

// Prometheus' rules for names and label names ([a-zA-Z_:][a-zA-Z0-9_:]*, [a-zA-Z_][a-zA-Z0-9_]*).
bool IsValidMetricName(const std::string& name);
bool IsValidLabelName(const std::string& name);

}  // namespace moesnap::metrics

#endif  // MOESNAP_COMMON_METRICS_H_
