// Registry and exposition. Registration and scrapes take a lock; updates never do.
#include "common/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace moesnap::metrics {
namespace {

[[noreturn]] void Misuse(const std::string& what) {
  std::fprintf(stderr, "metrics: %s\n", what.c_str());
  std::abort();
}

void CheckName(const std::string& name, const std::string& type, const Labels& labels) {
  if (!IsValidMetricName(name)) Misuse(absl::StrCat("'", name, "' is not a valid metric name"));
  if (type == "counter" && !absl::EndsWith(name, "_total")) {
    Misuse(absl::StrCat("counter '", name, "' must end in _total"));
  }
  for (const auto& [label, value] : labels) {
    if (!IsValidLabelName(label) || absl::StartsWith(label, "__") || label == "le") {
      Misuse(absl::StrCat("'", label, "' is not a valid label name for ", name));
    }
  }
}

std::string Number(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // Whole numbers print whole (byte counts read as they are); others in the shortest exact form.
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    return absl::StrCat(static_cast<int64_t>(value));
  }
  char buffer[32];
  const std::to_chars_result written = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, written.ptr);
}

std::string EscapeHelp(const std::string& help) {
  std::string out;
  for (const char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// {a="x",b="y"}, or nothing without labels; `extra` (the histogram's le) comes last.
std::string LabelText(const Labels& labels, const std::string& extra = "") {
  if (labels.empty() && extra.empty()) return "";
  std::string out = "{";
  for (const auto& [name, value] : labels) {
    if (out.size() > 1) out += ',';
    absl::StrAppend(&out, name, "=\"");
    for (const char c : value) {
      if (c == '\\') {
        out += "\\\\";
      } else if (c == '"') {
        out += "\\\"";
      } else if (c == '\n') {
        out += "\\n";
      } else {
        out += c;
      }
    }
    out += '"';
  }
  if (!extra.empty()) absl::StrAppend(&out, out.size() > 1 ? "," : "", extra);
  return out + "}";
}

}  // namespace

bool IsValidMetricName(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = absl::ascii_isalpha(c) || c == '_' || c == ':' || (i > 0 && absl::ascii_isdigit(c));
    if (!ok) return false;
  }
  return true;
}

bool IsValidLabelName(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (!(absl::ascii_isalpha(c) || c == '_' || (i > 0 && absl::ascii_isdigit(c)))) return false;
  }
  return true;
}

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)),
      buckets_(new std::atomic<uint64_t>[upper_bounds_.size() + 1]) {
  for (size_t i = 0; i < upper_bounds_.size(); ++i) {
    if (!std::isfinite(upper_bounds_[i]) || (i > 0 && upper_bounds_[i] <= upper_bounds_[i - 1])) {
      Misuse("histogram bounds must be finite and strictly ascending");
    }
  }
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  // The first bound >= value: Prometheus buckets are "less than or equal".
  const size_t bucket =
      std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) - upper_bounds_.begin();
  buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

Histogram::Counts Histogram::Read() const {
  Counts counts;
  uint64_t running = 0;
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) {
    running += buckets_[i].load(std::memory_order_relaxed);
    counts.cumulative.push_back(running);
  }
  counts.count = running;
  counts.sum = sum_.load(std::memory_order_relaxed);
  return counts;
}

std::vector<double> DurationBuckets() {
  std::vector<double> bounds;
  for (double decade = 1e-4; decade < 100; decade *= 10) {
    for (double step : {1.0, 2.5, 5.0}) bounds.push_back(decade * step);
  }
  bounds.push_back(100);
  return bounds;
}

std::vector<double> ByteBuckets() {
  std::vector<double> bounds;
  for (double bytes = 4096; bytes <= 64.0 * (1ULL << 30); bytes *= 4) bounds.push_back(bytes);
  return bounds;
}

void Collection::AddGauge(const std::string& name, const std::string& help, double value, Labels labels) {
  CheckName(name, "gauge", labels);
  samples_.push_back({name, help, "gauge", std::move(labels), value});
}

void Collection::AddCounter(const std::string& name, const std::string& help, double value,
                         Labels labels) {
  CheckName(name, "counter", labels);
  samples_.push_back({name, help, "counter", std::move(labels), value});
}

CollectorHandle& CollectorHandle::operator=(CollectorHandle&& other) noexcept {
  if (this != &other) {
    if (registry_ != nullptr) registry_->RemoveCollector(id_);
    registry_ = std::exchange(other.registry_, nullptr);
    id_ = other.id_;
  }
  return *this;
}

CollectorHandle::~CollectorHandle() {
  if (registry_ != nullptr) registry_->RemoveCollector(id_);
}

Registry& Registry::Default() {
  static Registry* registry = new Registry();  // never destroyed: metrics outlive every thread
  return *registry;
}

Registry::Family& Registry::FamilyFor(const std::string& name, const std::string& help,
                                      const std::string& type, const Labels& labels) {
  CheckName(name, type, labels);
  auto [it, inserted] = families_.try_emplace(name);
  if (inserted) {
    it->second.help = help;
    it->second.type = type;
  } else if (it->second.type != type || it->second.help != help) {
    Misuse(absl::StrCat("'", name, "' registered again as a ", type, " or with another help text"));
  }
  return it->second;
}

Counter& Registry::AddCounter(const std::string& name, const std::string& help, const Labels& labels) {
  absl::MutexLock lock(&metrics_mutex_);
  std::unique_ptr<Counter>& counter = FamilyFor(name, help, "counter", labels).counters[labels];
  if (counter == nullptr) counter = std::make_unique<Counter>();
  return *counter;
}

Gauge& Registry::AddGauge(const std::string& name, const std::string& help, const Labels& labels) {
  absl::MutexLock lock(&metrics_mutex_);
  std::unique_ptr<Gauge>& gauge = FamilyFor(name, help, "gauge", labels).gauges[labels];
  if (gauge == nullptr) gauge = std::make_unique<Gauge>();
  return *gauge;
}

Histogram& Registry::AddHistogram(const std::string& name, const std::string& help,
                                  std::vector<double> upper_bounds, const Labels& labels) {
  absl::MutexLock lock(&metrics_mutex_);
  std::unique_ptr<Histogram>& histogram =
      FamilyFor(name, help, "histogram", labels).histograms[labels];
  if (histogram == nullptr) {
    histogram = std::make_unique<Histogram>(std::move(upper_bounds));
  } else if (histogram->upper_bounds() != upper_bounds) {
    Misuse(absl::StrCat("histogram '", name, "' registered again with other buckets"));
  }
  return *histogram;
}

CollectorHandle Registry::AddCollector(std::function<void(Collection&)> collect) {
  absl::MutexLock lock(&collectors_mutex_);
  const int id = next_collector_++;
  collectors_.emplace(id, std::move(collect));
  return CollectorHandle(this, id);
}

void Registry::RemoveCollector(int id) {
  absl::MutexLock lock(&collectors_mutex_);
  collectors_.erase(id);
}

std::string Registry::Exposition() {
  Collection collected;
  {
    absl::MutexLock lock(&collectors_mutex_);
    for (auto& [id, collect] : collectors_) collect(collected);
  }
  struct Out {
    std::string help, type, lines;
  };
  std::map<std::string, Out> families;
  {
    absl::MutexLock lock(&metrics_mutex_);
    for (const auto& [name, family] : families_) {
      Out& out = families[name];
      out.help = family.help;
      out.type = family.type;
      for (const auto& [labels, counter] : family.counters) {
        absl::StrAppend(&out.lines, name, LabelText(labels), " ", counter->value(), "\n");
      }
      for (const auto& [labels, gauge] : family.gauges) {
        absl::StrAppend(&out.lines, name, LabelText(labels), " ", Number(gauge->value()), "\n");
      }
      for (const auto& [labels, histogram] : family.histograms) {
        const Histogram::Counts counts = histogram->Read();
        const std::vector<double>& bounds = histogram->upper_bounds();
        for (size_t i = 0; i <= bounds.size(); ++i) {
          const std::string le =
              absl::StrCat("le=\"", i < bounds.size() ? Number(bounds[i]) : "+Inf", "\"");
          absl::StrAppend(&out.lines, name, "_bucket", LabelText(labels, le), " ",
                          counts.cumulative[i], "\n");
        }
        absl::StrAppend(&out.lines, name, "_sum", LabelText(labels), " ", Number(counts.sum), "\n",
                        name, "_count", LabelText(labels), " ", counts.count, "\n");
      }
    }
  }
  for (const Collection::Sample& sample : collected.samples_) {
    auto [it, inserted] = families.try_emplace(sample.name);
    Out& out = it->second;
    if (inserted) {
      out.help = sample.help;
      out.type = sample.type;
    } else if (out.type != sample.type) {
      continue;  // a collector's sample under a registered name of another type is not exposed
    }
    absl::StrAppend(&out.lines, sample.name, LabelText(sample.labels), " ", Number(sample.value), "\n");
  }
  std::string text;
  for (const auto& [name, out] : families) {
    absl::StrAppend(&text, "# HELP ", name, " ", EscapeHelp(out.help), "\n# TYPE ", name, " ",
                    out.type, "\n", out.lines);
  }
  return text;
}

}  // namespace moesnap::metrics
