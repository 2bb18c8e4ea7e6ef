// Log: a level filter and a line writer; fputs of one whole line keeps lines from interleaving.
#include "common/log.h"

#include <atomic>
#include <cstdio>
#include <ctime>
#include <string>

#include "absl/strings/str_format.h"

namespace moesnap {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
constexpr const char* kNames[] = {"debug", "info", "warning", "error"};
}  // namespace

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

void LogLine(LogLevel level, absl::string_view message) {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  tm utc{};
  gmtime_r(&now.tv_sec, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &utc);
  const std::string line = absl::StrFormat("%s.%03dZ %s %s\n", stamp, now.tv_nsec / 1000000,
                                           kNames[static_cast<int>(level)], message);
  std::fputs(line.c_str(), stderr);
}

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view text) {
  for (int i = 0; i < 4; ++i) {
    if (text == kNames[i]) return static_cast<LogLevel>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("log level '", text, "' is not one of debug, info, warning, error"));
}

}  // namespace moesnap
