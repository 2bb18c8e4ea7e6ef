// Log lines as an operator's tools read them: UTC RFC 3339 times with zero-padded milliseconds, the
// text format's key=value fields and escaped control characters, and JSON lines with node, step,
// rank and duration.
#include "common/log.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moesnap {
namespace {

// Everything written to stderr while `emit` runs.
template <typename Emit>
std::string CaptureStderr(Emit emit) {
  std::fflush(stderr);
  char path[] = "/tmp/moesnap-log-test-XXXXXX";
  const int file = mkstemp(path);
  const int saved = dup(2);
  dup2(file, 2);
  emit();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(file);
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  unlink(path);
  return text.str();
}

void ExpectRecentUtc(const std::string& stamp) {
  absl::Time parsed;
  std::string error;
  ASSERT_TRUE(absl::ParseTime("%Y-%m-%dT%H:%M:%E3SZ", stamp, absl::UTCTimeZone(), &parsed, &error))
      << stamp << ": " << error;
  EXPECT_LT(absl::AbsDuration(absl::Now() - parsed), absl::Seconds(10)) << stamp;
}

TEST(LogTest, TextLinesHaveUtcMillisecondsAndFields) {
  ConfigureLog(LogLevel::kInfo, LogFormat::kText, 4);
  const std::string text = CaptureStderr([] {
    Log(LogLevel::kInfo, LogFields{.step = 7, .rank = 3, .duration_seconds = 0.012}, "committed");
    Log(LogLevel::kWarning, "plain");
    Log(LogLevel::kDebug, "filtered out");
  });
  const std::regex line(
      R"((\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) info committed step=7 rank=3 duration_seconds=0\.012000
(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) warning plain
)");
  std::smatch match;
  ASSERT_TRUE(std::regex_match(text, match, line)) << text;
  ExpectRecentUtc(match[1]);
}

// Names in messages come from peers and trainers: none of them starts a line of its own.
TEST(LogTest, TextLinesEscapeControlCharacters) {
  ConfigureLog(LogLevel::kInfo, LogFormat::kText, std::nullopt);
  const std::string text = CaptureStderr([] {
    Log(LogLevel::kWarning,
        "region 'a\n2026-01-01T00:00:00.000Z error forged\r\t\x01\x7f\xc3\xa9'");
  });
  const std::regex line(
      R"re(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z warning region 'a\\n2026-01-01T00:00:00\.000Z error forged\\r\\t\\x01\\x7f\xc3\xa9'
)re");
  EXPECT_TRUE(std::regex_match(text, line)) << text;
}

// A JSON line is one JSON object whatever the message holds: quotes, backslashes and control
// characters are escaped.
TEST(LogTest, JsonLinesCarryNodeStepRankAndDuration) {
  ConfigureLog(LogLevel::kDebug, LogFormat::kJson, 4);
  const std::string text = CaptureStderr([] {
    Log(LogLevel::kError, LogFields{.step = 9, .rank = 1, .duration_seconds = 1.5},
        "a \"quoted\"\nmessage \\ \r\x01");
    Log(LogLevel::kDebug, LogFields{.node = 2}, "from a peer");
  });
  ConfigureLog(LogLevel::kInfo, LogFormat::kText, std::nullopt);
  const std::regex lines(
      R"re(\{"time":"([^"]+)","level":"error","message":"a \\"quoted\\"\\nmessage \\\\ \\r\\u0001","node":4,"step":9,"rank":1,"duration_seconds":1\.500000\}
\{"time":"[^"]+","level":"debug","message":"from a peer","node":2\}
)re");
  std::smatch match;
  ASSERT_TRUE(std::regex_match(text, match, lines)) << text;
  ExpectRecentUtc(match[1]);
}

TEST(LogTest, ParsesLevelsAndFormats) {
  EXPECT_EQ(*ParseLogLevel("warning"), LogLevel::kWarning);
  EXPECT_FALSE(ParseLogLevel("loud").ok());
  EXPECT_EQ(*ParseLogFormat("json"), LogFormat::kJson);
  EXPECT_FALSE(ParseLogFormat("xml").ok());
}

}  // namespace
}  // namespace moesnap
