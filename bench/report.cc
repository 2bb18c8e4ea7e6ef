// Report: table, JSON and Markdown output of benchmark records.
#include "bench/report.h"

#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/match.h"

namespace moesnap::bench {
namespace {

std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string Today() {
  const std::time_t now = std::time(nullptr);
  char buffer[32];
  std::strftime(buffer, sizeof(buffer), "%Y-%m-%d", std::gmtime(&now));
  return buffer;
}

}  // namespace

constexpr char kRowFormat[] = "%-9s %-46s %10.3f %-5s | %-30s %10.3f | %6.3f\n";

void Report::PrintHeader() {
  absl::PrintF("%-9s %-46s %10s %-5s | %-30s %10s | %6s\n", "suite", "figure", "value", "unit",
               "baseline", "value", "ratio");
}

void Report::Add(Record record) {
  absl::PrintF(kRowFormat, record.suite, record.name, record.value, record.unit, record.baseline,
               record.baseline_value, record.ratio);
  std::fflush(stdout);
  records_.push_back(std::move(record));
}

void Report::AddNote(const std::string& suite, const std::string& note) {
  notes_.emplace_back(suite, note);
}

absl::Status Report::WriteJson(const std::string& path) const {
  std::ofstream out(path);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write JSON results to ", path));
  out << "[\n";
  for (size_t i = 0; i < records_.size(); ++i) {
    const Record& r = records_[i];
    out << absl::StrFormat(
        "  {\"suite\": %s, \"name\": %s, \"value\": %.6g, \"unit\": %s, \"baseline\": %s, "
        "\"baseline_value\": %.6g, \"ratio\": %.6g}%s\n",
        JsonString(r.suite), JsonString(r.name), r.value, JsonString(r.unit),
        JsonString(r.baseline), r.baseline_value, r.ratio, i + 1 < records_.size() ? "," : "");
  }
  out << "]\n";
  return out.good() ? absl::OkStatus()
                    : absl::DataLossError(absl::StrCat("short write of JSON results to ", path));
}

absl::Status Report::WriteMarkdown(const std::string& path, const std::string& command) const {
  std::ofstream out(path);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write Markdown results to ", path));
  out << "# moesnap benchmark results\n\n"
      << "Date: " << Today() << "  \nMachine: " << MachineDescription() << "  \nCommand: `"
      << command << "`\n\n"
      << "Every figure is printed beside its baseline, measured on the same buffers in the same run; "
         "ratio = figure / baseline.\n";
  std::map<std::string, std::vector<const Record*>> by_suite;
  for (const Record& r : records_) by_suite[r.suite].push_back(&r);
  for (const auto& [suite, records] : by_suite) {
    out << "\n## " << suite << "\n\n| figure | value | unit | baseline | baseline value | ratio |\n"
        << "| --- | ---: | --- | --- | ---: | ---: |\n";
    for (const Record* r : records) {
      out << absl::StrFormat("| %s | %.3f | %s | %s | %.3f | %.3f |\n", r->name, r->value, r->unit,
                             r->baseline, r->baseline_value, r->ratio);
    }
    for (const auto& [note_suite, note] : notes_) {
      if (note_suite == suite) out << "\n" << note << "\n";
    }
  }
  return out.good() ? absl::OkStatus()
                    : absl::DataLossError(absl::StrCat("short write of Markdown results to ", path));
}

std::string MachineDescription() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(cpuinfo, line)) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) model = line.substr(colon + 2);
      break;
    }
  }
  return absl::StrCat(model, ", nproc ", sysconf(_SC_NPROCESSORS_ONLN));
}

}  // namespace moesnap::bench
