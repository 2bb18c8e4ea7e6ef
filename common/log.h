// Structured, leveled logging to stderr (journald picks it up under systemd): one line per event,
// "time level message". Thread-safe. The level is process-wide and set once from the config.
#ifndef MOESNAP_COMMON_LOG_H_
#define MOESNAP_COMMON_LOG_H_

#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace moesnap {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, absl::string_view message);
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view text);

template <typename... Parts>
void Log(LogLevel level, const Parts&... parts) {
  if (LogEnabled(level)) LogLine(level, absl::StrCat(parts...));
}

}  // namespace moesnap

#endif  // MOESNAP_COMMON_LOG_H_
