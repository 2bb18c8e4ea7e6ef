// The figures a benchmark suite produces, each beside the physical limit measured in the same run,
// and the three ways they are written: a table for people, JSON records for scripts, and the
// Markdown kept in bench/RESULTS.md.
#ifndef MOESNAP_BENCH_REPORT_H_
#define MOESNAP_BENCH_REPORT_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace moesnap::bench {

// One figure. `baseline` names what it is compared with ("raw ec_encode_data", "memcpy"), measured on
// the same buffers in the same run; ratio = value / baseline_value (for times, the caller states the
// direction in the name).
struct Record {
  std::string suite;
  std::string name;
  double value = 0;
  std::string unit;
  std::string baseline;
  double baseline_value = 0;
  double ratio = 0;
};

class Report {
 public:
  // Keeps the record and prints it as one row of a table on stdout, so long runs show progress.
  void Add(Record record);
  static void PrintHeader();
  // A sentence printed under the suite's table: the conditions a reader needs to interpret it.
  void AddNote(const std::string& suite, const std::string& note);
  const std::vector<Record>& records() const { return records_; }

  // [{"suite", "name", "value", "unit", "baseline", "baseline_value", "ratio"}, ...]
  absl::Status WriteJson(const std::string& path) const;
  // A Markdown document: date, machine, one table per suite.
  absl::Status WriteMarkdown(const std::string& path, const std::string& command) const;

 private:
  std::vector<Record> records_;
  std::vector<std::pair<std::string, std::string>> notes_;  // (suite, note)
};

// "Intel(R) Xeon(R) ... (2 cores)", from /proc/cpuinfo and the online CPU count.
std::string MachineDescription();

}  // namespace moesnap::bench

#endif  // MOESNAP_BENCH_REPORT_H_
