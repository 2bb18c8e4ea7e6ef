// moesnap-bench: runs benchmark suites (those named, or all of them) in one process and writes the
// figures as a table, as JSON records and as the Markdown of bench/RESULTS.md.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <utility>
#include <vector>
#include <string>

#include <CLI/CLI.hpp>

#include "absl/strings/str_join.h"
#include "bench/report.h"
#include "bench/suites.h"
#include "common/version.h"
#include "daemon/daemon.h"

int main(int argc, char** argv) {
  using moesnap::bench::Report;
  // In run order: ettr models the figures of the suites before it.
  const std::vector<std::pair<std::string, std::function<absl::Status(Report&)>>> suites = {
      {"erasure", moesnap::bench::RunErasureSuite},
      {"capture", moesnap::bench::RunCaptureSuite},
      {"replicas", moesnap::bench::RunReplicaSuite},
      {"dataplane", moesnap::bench::RunDataPlaneSuite},
      {"cluster", moesnap::bench::RunClusterSuite},
      {"etcd", moesnap::bench::RunEtcdSuite},
      {"peers", moesnap::bench::RunPeersSuite},
      {"sparse", moesnap::bench::RunSparseSuite},
      {"elastic", moesnap::bench::RunElasticSuite},
      {"durable", moesnap::bench::RunDurableSuite},
      {"gpu", moesnap::bench::RunGpuSuite},
      {"ettr", moesnap::bench::RunEttrSuite},
  };

  CLI::App app{"moesnap benchmarks: every figure beside its physical limit, measured in one run"};
  std::vector<std::string> chosen;
  std::string json_path;
  std::string markdown_path;
  std::vector<std::string> names;
  for (const auto& [name, run] : suites) names.push_back(name);
  names.push_back("all");
  app.add_option("suite", chosen,
                 "Suites to run, in the order listed here whatever the order given (ettr models "
                 "the figures of those before it): " + absl::StrJoin(names, ", "))
      ->required()
      ->check(CLI::IsMember(names));
  app.add_option("--json", json_path, "Also write the figures as JSON records to this file");
  app.add_option("--markdown", markdown_path,
                 "Also write the figures as Markdown (the format of bench/RESULTS.md) to this file");
  app.set_version_flag("--version", moesnap::VersionLine("moesnap-bench"));
  CLI11_PARSE(app, argc, argv);
  moesnap::daemon::StopLockOrderTracking();  // the suites' daemons run as moesnapd runs them

  std::printf("machine: %s\n", moesnap::bench::MachineDescription().c_str());
  Report::PrintHeader();
  Report report;
  const bool all = std::find(chosen.begin(), chosen.end(), "all") != chosen.end();
  for (const auto& [name, run] : suites) {
    if (!all && std::find(chosen.begin(), chosen.end(), name) == chosen.end()) continue;
    absl::Status status = run(report);
    if (absl::IsUnavailable(status) && all) {
      std::printf("%-9s skipped: %s\n", name.c_str(), std::string(status.message()).c_str());
      continue;
    }
    if (!status.ok()) {
      std::fprintf(stderr, "moesnap-bench: suite %s failed: %s\n", name.c_str(),
                   status.ToString().c_str());
      return 1;
    }
  }
  if (!json_path.empty()) {
    if (absl::Status status = report.WriteJson(json_path); !status.ok()) {
      std::fprintf(stderr, "moesnap-bench: %s\n", status.ToString().c_str());
      return 1;
    }
  }
  if (!markdown_path.empty()) {
    const std::string command = "moesnap-bench " + absl::StrJoin(chosen, " ");
    if (absl::Status status = report.WriteMarkdown(markdown_path, command); !status.ok()) {
      std::fprintf(stderr, "moesnap-bench: %s\n", status.ToString().c_str());
      return 1;
    }
  }
  return 0;
}
