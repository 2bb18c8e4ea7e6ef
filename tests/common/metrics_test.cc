// The metrics unit: the text exposition byte for byte, histogram buckets at and around their
// bounds, concurrent updates, collectors and their removal.
#include "common/metrics.h"

#include <gtest/gtest.h>

#include <thread>

#include "absl/strings/match.h"

namespace moesnap::metrics {
namespace {

TEST(MetricsTest, ExpositionHasHelpTypeAndSamplesPerFamilySortedByName) {
  Registry registry;
  registry.AddCounter("moesnap_steps_total", "Steps by outcome", {{"outcome", "committed"}}).Add(3);
  registry.AddCounter("moesnap_steps_total", "Steps by outcome", {{"outcome", "aborted"}}).Add();
  registry.AddGauge("moesnap_rebuild_bytes_per_second", "Rate of the last rebuild").Set(2.5e8);
  Histogram& histogram =
      registry.AddHistogram("moesnap_commit_seconds", "Capture to commit", {0.01, 0.1, 1});
  histogram.Observe(0.0625);
  histogram.Observe(0.25);
  EXPECT_EQ(registry.Exposition(),
            "# HELP moesnap_commit_seconds Capture to commit\n"
            "# TYPE moesnap_commit_seconds histogram\n"
            "moesnap_commit_seconds_bucket{le=\"0.01\"} 0\n"
            "moesnap_commit_seconds_bucket{le=\"0.1\"} 1\n"
            "moesnap_commit_seconds_bucket{le=\"1\"} 2\n"
            "moesnap_commit_seconds_bucket{le=\"+Inf\"} 2\n"
            "moesnap_commit_seconds_sum 0.3125\n"
            "moesnap_commit_seconds_count 2\n"
            "# HELP moesnap_rebuild_bytes_per_second Rate of the last rebuild\n"
            "# TYPE moesnap_rebuild_bytes_per_second gauge\n"
            "moesnap_rebuild_bytes_per_second 250000000\n"
            "# HELP moesnap_steps_total Steps by outcome\n"
            "# TYPE moesnap_steps_total counter\n"
            "moesnap_steps_total{outcome=\"aborted\"} 1\n"
            "moesnap_steps_total{outcome=\"committed\"} 3\n");
}

TEST(MetricsTest, HistogramBucketsAreLessOrEqualAndCumulative) {
  Histogram histogram({1, 2, 4});
  for (double value : {0.0, 1.0, 1.0000001, 2.0, 3.9, 4.0, 4.1, 1e9, -5.0}) histogram.Observe(value);
  histogram.Observe(std::nan(""));  // ignored: it belongs to no bucket
  const Histogram::Counts counts = histogram.Read();
  // <=1: 0, 1, -5; <=2: + 1.0000001, 2; <=4: + 3.9, 4; +Inf: + 4.1, 1e9.
  EXPECT_EQ(counts.cumulative, (std::vector<uint64_t>{3, 5, 7, 9}));
  EXPECT_EQ(counts.count, 9u);
  EXPECT_DOUBLE_EQ(counts.sum, 0 + 1 + 1.0000001 + 2 + 3.9 + 4 + 4.1 + 1e9 - 5);
}

TEST(MetricsTest, StandardBucketsAscend) {
  for (const std::vector<double>& bounds : {DurationBuckets(), ByteBuckets()}) {
    ASSERT_GT(bounds.size(), 5u);
    for (size_t i = 1; i < bounds.size(); ++i) EXPECT_LT(bounds[i - 1], bounds[i]);
  }
  EXPECT_DOUBLE_EQ(DurationBuckets().front(), 1e-4);
  EXPECT_DOUBLE_EQ(DurationBuckets().back(), 100);
  EXPECT_DOUBLE_EQ(ByteBuckets().front(), 4096);
}

TEST(MetricsTest, ConcurrentUpdatesAreAllCounted) {
  Registry registry;
  Counter& counter = registry.AddCounter("moesnap_test_total", "test");
  Histogram& histogram = registry.AddHistogram("moesnap_test_seconds", "test", {0.5});
  Gauge& gauge = registry.AddGauge("moesnap_test_bytes", "test");
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100000; ++i) {
        counter.Add();
        histogram.Observe(i % 2 == 0 ? 0.25 : 0.75);
        gauge.Add(1);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(counter.value(), 400000u);
  EXPECT_EQ(histogram.Read().cumulative, (std::vector<uint64_t>{200000, 400000}));
  EXPECT_DOUBLE_EQ(histogram.Read().sum, 200000 * 0.25 + 200000 * 0.75);
  EXPECT_DOUBLE_EQ(gauge.value(), 400000);
}

TEST(MetricsTest, RegisteringAgainReturnsTheSameMetric) {
  Registry registry;
  Counter& first = registry.AddCounter("moesnap_a_total", "a", {{"peer", "1"}});
  Counter& again = registry.AddCounter("moesnap_a_total", "a", {{"peer", "1"}});
  Counter& other = registry.AddCounter("moesnap_a_total", "a", {{"peer", "2"}});
  EXPECT_EQ(&first, &again);
  EXPECT_NE(&first, &other);
}

TEST(MetricsTest, CollectorsAddSamplesAtScrapeTimeUntilTheirHandleDies) {
  Registry registry;
  double used = 10;
  {
    CollectorHandle handle = registry.AddCollector([&used](Collection& collection) {
      collection.AddGauge("moesnap_pool_used_bytes", "Committed bytes", used);
      collection.AddGauge("moesnap_peer_up", "Peer answers", 1, {{"peer", "1"}});
      collection.AddGauge("moesnap_peer_up", "Peer answers", 0, {{"peer", "2"}});
    });
    used = 4096;
    const std::string text = registry.Exposition();
    EXPECT_TRUE(absl::StrContains(text, "moesnap_pool_used_bytes 4096\n")) << text;
    EXPECT_TRUE(absl::StrContains(text,
                                  "# HELP moesnap_peer_up Peer answers\n# TYPE moesnap_peer_up gauge\n"
                                  "moesnap_peer_up{peer=\"1\"} 1\nmoesnap_peer_up{peer=\"2\"} 0\n"))
        << text;
  }
  EXPECT_EQ(registry.Exposition(), "");
}

TEST(MetricsTest, EscapesLabelValuesAndHelp) {
  Registry registry;
  registry.AddGauge("moesnap_g", "line one\nback\\slash", {{"path", "a\"b\\c\nd"}}).Set(0.125);
  EXPECT_EQ(registry.Exposition(),
            "# HELP moesnap_g line one\\nback\\\\slash\n# TYPE moesnap_g gauge\n"
            "moesnap_g{path=\"a\\\"b\\\\c\\nd\"} 0.125\n");
}

TEST(MetricsDeathTest, MisnamedMetricsAreProgrammingErrors) {
  Registry registry;
  EXPECT_DEATH(registry.AddCounter("moesnap_steps", "no _total"), "must end in _total");
  EXPECT_DEATH(registry.AddGauge("2bad", "x"), "not a valid metric name");
  EXPECT_DEATH(registry.AddGauge("moesnap_x", "x", {{"le", "1"}}), "not a valid label name");
  registry.AddGauge("moesnap_y", "y");
  EXPECT_DEATH(registry.AddCounter("moesnap_y", "y"), "");
}

}  // namespace
}  // namespace moesnap::metrics
