// Log over spdlog: one synchronous logger on stderr with a UTC pattern. Custom pattern flags write
// the message escaped, as a JSON string (%j) or as text (%V), and the event's fields (%k); the
// fields reach the formatter through a thread-local, since a synchronous logger formats on the
// calling thread.
#include "common/log.h"

#include <atomic>
#include <memory>
#include <string>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"

namespace moesnap {
namespace {

constexpr const char* kNames[] = {"debug", "info", "warning", "error"};
constexpr spdlog::level::level_enum kSpdlogLevels[] = {spdlog::level::debug, spdlog::level::info,
                                                       spdlog::level::warn, spdlog::level::err};

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
thread_local const LogFields* t_fields = nullptr;

// How a message is escaped for the log's format.
enum class Escaping {
  kJsonString,  // quoted; ", \ and control characters escaped (\n, \r, \t, \u00NN)
  kText,        // control characters escaped (\n, \r, \t, \xNN), so that a name a peer or a
                // trainer chose cannot start a line of its own
};

void AppendEscaped(absl::string_view text, Escaping escaping, spdlog::memory_buf_t& out) {
  const bool json = escaping == Escaping::kJsonString;
  if (json) out.push_back('"');
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    std::string_view named;
    switch (c) {
      case '\n': named = "\\n"; break;
      case '\r': named = "\\r"; break;
      case '\t': named = "\\t"; break;
      case '"': if (json) named = "\\\""; break;
      case '\\': if (json) named = "\\\\"; break;
      default: break;
    }
    if (!named.empty()) {
      out.append(named);
    } else if (byte < 0x20 || (!json && byte == 0x7f)) {
      const std::string escaped =
          json ? absl::StrFormat("\\u%04x", byte) : absl::StrFormat("\\x%02x", byte);
      out.append(std::string_view(escaped));
    } else {
      out.push_back(c);
    }
  }
  if (json) out.push_back('"');
}

// %j (a JSON string) and %V (text): the message, escaped.
template <Escaping kEscaping>
class MessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& message, const std::tm&,
              spdlog::memory_buf_t& out) override {
    AppendEscaped(absl::string_view(message.payload.data(), message.payload.size()), kEscaping,
                  out);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<MessageFlag>();
  }
};

// %k: ,"node":N,"step":S,... for the fields present (JSON), or " step=S ..." (text).
class FieldsFlag final : public spdlog::custom_flag_formatter {
 public:
  FieldsFlag(bool json, std::optional<uint32_t> node) : json_(json), node_(node) {}

  void format(const spdlog::details::log_msg&, const std::tm&, spdlog::memory_buf_t& out) override {
    std::string text;
    auto add = [&](const char* key, const std::string& value) {
      absl::StrAppend(&text, json_ ? absl::StrCat(",\"", key, "\":") : absl::StrCat(" ", key, "="),
                      value);
    };
    const LogFields none;
    const LogFields& fields = t_fields != nullptr ? *t_fields : none;
    // The node an event is about: one named by the event, else (in JSON) this daemon's own.
    if (fields.node || (json_ && node_)) add("node", absl::StrCat(fields.node.value_or(node_.value_or(0))));
    if (fields.step) add("step", absl::StrCat(*fields.step));
    if (fields.rank) add("rank", absl::StrCat(*fields.rank));
    if (fields.duration_seconds) add("duration_seconds", absl::StrFormat("%.6f", *fields.duration_seconds));
    out.append(std::string_view(text));
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<FieldsFlag>(json_, node_);
  }

 private:
  bool json_;
  std::optional<uint32_t> node_;
};

std::shared_ptr<spdlog::logger> MakeLogger(LogFormat format, std::optional<uint32_t> node) {
  auto logger = std::make_shared<spdlog::logger>(
      "moesnap", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  auto formatter = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc,
                                                               std::string("\n"));
  const bool json = format == LogFormat::kJson;
  formatter->add_flag<MessageFlag<Escaping::kJsonString>>('j');
  formatter->add_flag<MessageFlag<Escaping::kText>>('V');
  formatter->add_flag<FieldsFlag>('k', json, node);
  formatter->set_pattern(json ? R"({"time":"%Y-%m-%dT%H:%M:%S.%eZ","level":"%l","message":%j%k})"
                              : "%Y-%m-%dT%H:%M:%S.%eZ %l %V%k");
  logger->set_formatter(std::move(formatter));
  logger->set_level(spdlog::level::trace);  // filtered by LogEnabled before formatting
  return logger;
}

// The logger in use; replaced whole by ConfigureLog, so a line is written by one or the other.
absl::Mutex g_logger_mutex;
std::shared_ptr<spdlog::logger>& Logger() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_logger_mutex) {
  static auto* logger = new std::shared_ptr<spdlog::logger>(MakeLogger(LogFormat::kText, std::nullopt));
  return *logger;
}

}  // namespace

void ConfigureLog(LogLevel level, LogFormat format, std::optional<uint32_t> node) {
  SetLogLevel(level);
  std::shared_ptr<spdlog::logger> logger = MakeLogger(format, node);
  absl::MutexLock lock(&g_logger_mutex);
  Logger() = std::move(logger);
}

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

void LogLine(LogLevel level, const LogFields& fields, absl::string_view message) {
  std::shared_ptr<spdlog::logger> logger;
  {
    absl::MutexLock lock(&g_logger_mutex);
    logger = Logger();
  }
  t_fields = &fields;
  logger->log(kSpdlogLevels[static_cast<int>(level)],
              spdlog::string_view_t(message.data(), message.size()));
  t_fields = nullptr;
}

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view text) {
  for (int i = 0; i < 4; ++i) {
    if (text == kNames[i]) return static_cast<LogLevel>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("log level '", text, "' is not one of debug, info, warning, error"));
}

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view text) {
  if (text == "text") return LogFormat::kText;
  if (text == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(absl::StrCat("log format '", text, "' is not text or json"));
}

}  // namespace moesnap
