// The one logging entry point: Log(level, parts...) or Log(level, LogFields{...}, parts...), one line
// per event on stderr (journald picks it up under systemd), written by spdlog. Two formats:
//   text: 2026-11-23T19:35:04.087Z info message step=7 rank=3 duration_seconds=0.012
//   json: {"time":"2026-11-23T19:35:04.087Z","level":"info","message":"...","node":0,"step":7,...}
// Times are UTC, RFC 3339, milliseconds zero-padded. Thread-safe. Level and format are process-wide
// and set once from the config.
#ifndef MOESNAP_COMMON_LOG_H_
#define MOESNAP_COMMON_LOG_H_

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace moesnap {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
enum class LogFormat { kText, kJson };

// What an event is about, as separate fields for JSON consumers (and key=value in text).
struct LogFields {
  std::optional<int64_t> step = std::nullopt;
  std::optional<uint32_t> rank = std::nullopt;
  std::optional<uint32_t> node = std::nullopt;  // absent: this daemon's own (JSON lines carry one)
  std::optional<double> duration_seconds = std::nullopt;
};

// `node`: this daemon's id, written into every JSON line (nullopt in programs that have none).
void ConfigureLog(LogLevel level, LogFormat format, std::optional<uint32_t> node);
void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, const LogFields& fields, absl::string_view message);
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view text);
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view text);

template <typename... Parts>
void Log(LogLevel level, const Parts&... parts) {
  if (LogEnabled(level)) LogLine(level, LogFields{}, absl::StrCat(parts...));
}

template <typename... Parts>
void Log(LogLevel level, const LogFields& fields, const Parts&... parts) {
  if (LogEnabled(level)) LogLine(level, fields, absl::StrCat(parts...));
}

}  // namespace moesnap

#endif  // MOESNAP_COMMON_LOG_H_
