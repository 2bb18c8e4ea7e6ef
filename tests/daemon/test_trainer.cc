// moesnap-test-trainer: a stand-in for one trainer rank with deterministic state, for the crash
// tests. Region r holds, after step s, bytes that are a pure function of (rank, r, s); a step
// captures every region (full steps) or a subset (sparse steps), and changes exactly what it
// captures. So after any crash, the expected content of every region at the restored step is known.
//
//   train:  take the memory an exited process of the rank left (else allocate), restore the
//           latest committed step if there is one (verifying it), then run steps up to --steps,
//           each after --step-ms of "compute": change the step's regions, Snapshot,
//           print "snapshot S", WaitCaptured, print "captured S" (or "aborted S" when the cluster
//           aborted the step first).
//   verify: restore the latest committed step into fresh regions and compare every byte; print
//           "verified step S", "tier memory|durable" (where the restore came from) and "restored
//           B bytes in T ms into fresh|adopted memory in pages of P bytes" (huge pages under
//           MOESNAP_HUGE_PAGES=1) (exit 0) or the first mismatches (exit 1).
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "moesnap/client.h"
#include "tests/testing/deterministic_bytes.h"

namespace {

struct TrainerOptions {
  std::string socket;
  uint32_t rank = 0;
  int regions = 64;
  size_t region_bytes = 4 << 20;
  int64_t steps = 100;
  int step_ms = 0;  // the compute time of a step, spent before its snapshot
  std::string mode = "train";
};

// Steps 1, 5, 9, ... capture every region; the others capture regions with (region + step) % 3 == 0.
bool Captures(int region, int64_t step) { return step % 4 == 1 || (region + step) % 3 == 0; }

int64_t LastCaptured(int region, int64_t step) {
  while (step > 0 && !Captures(region, step)) --step;
  return step;
}

void FillExpected(uint8_t* out, size_t bytes, uint32_t rank, int region, int64_t step) {
  moesnap::testing::DeterministicBytes(uint64_t{rank} << 48 ^ uint64_t(region) << 32 ^ uint64_t(step))
      .Fill(out, bytes);
}

std::string RegionName(int region) {
  return absl::StrCat("layer", region / 8, ".expert", region % 8, ".master");
}

int Fail(const std::string& what, const absl::Status& status) {
  std::printf("error %s: %s\n", what.c_str(), status.ToString().c_str());
  std::fflush(stdout);
  return 3;
}

// Compares every region with its expected content at `step`; prints mismatches.
int CheckRegions(const TrainerOptions& options, const moesnap::SharedBuffer& buffer, int64_t step) {
  std::vector<uint8_t> expected(options.region_bytes);
  int mismatches = 0;
  for (int region = 0; region < options.regions; ++region) {
    const int64_t source_step = LastCaptured(region, step);
    FillExpected(expected.data(), expected.size(), options.rank, region, source_step);
    const uint8_t* actual = buffer.data() + region * options.region_bytes;
    if (std::memcmp(actual, expected.data(), expected.size()) != 0 && mismatches++ < 5) {
      std::printf("mismatch region %s: expected the bytes of step %lld\n", RegionName(region).c_str(),
                  static_cast<long long>(source_step));
    }
  }
  std::fflush(stdout);
  return mismatches == 0 ? 0 : 1;
}

int Run(const TrainerOptions& options) {
  absl::StatusOr<std::unique_ptr<moesnap::Client>> client =
      moesnap::Client::Connect({.socket_path = options.socket, .rank = options.rank});
  if (!client.ok()) return Fail("connect", client.status());
  // A restarted trainer takes the memory its rank's exited process left, when the daemon kept it;
  // verify restores into fresh memory, so that nothing but the restore can have written it.
  const size_t state_bytes = options.regions * options.region_bytes;
  absl::StatusOr<std::shared_ptr<moesnap::SharedBuffer>> buffer =
      options.mode == "train" ? (*client)->AdoptHost(state_bytes) : nullptr;
  if (!buffer.ok()) return Fail("adopt", buffer.status());
  const bool adopted = *buffer != nullptr;
  if (!adopted) buffer = (*client)->AllocateHost(state_bytes);
  if (!buffer.ok()) return Fail("allocate", buffer.status());
  for (int region = 0; region < options.regions; ++region) {
    const moesnap::RegionInfo info{RegionName(region), "uint8",
                                   {static_cast<int64_t>(options.region_bytes)}};
    if (absl::Status status = (*client)->RegisterHostRegion(
            info, *buffer, region * options.region_bytes, options.region_bytes);
        !status.ok()) {
      return Fail("register", status);
    }
  }

  int64_t step = 0;
  absl::StatusOr<std::optional<int64_t>> latest = (*client)->LatestCommitted();
  if (!latest.ok()) return Fail("latest", latest.status());
  if (latest->has_value() || options.mode == "verify") {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<moesnap::RestoreResult> restored = (*client)->Restore();
    if (!restored.ok()) return Fail("restore", restored.status());
    const double milliseconds =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    step = restored->step;
    if (int result = CheckRegions(options, **buffer, step); result != 0) return result;
    std::printf("verified step %lld\n", static_cast<long long>(step));
    std::printf("tier %s\n", restored->tier == moesnap::RestoreTier::kDurable ? "durable" : "memory");
    std::printf("restored %zu bytes in %.1f ms into %s memory in pages of %zu bytes\n",
                state_bytes, milliseconds, adopted ? "adopted" : "fresh", (*buffer)->page_bytes());
    std::fflush(stdout);
  }
  if (options.mode == "verify") return 0;

  for (++step; step <= options.steps; ++step) {
    // A real step computes before it snapshots; without this, steps follow back to back.
    std::this_thread::sleep_for(std::chrono::milliseconds(options.step_ms));
    std::vector<std::string> names;
    for (int region = 0; region < options.regions; ++region) {
      if (!Captures(region, step)) continue;
      FillExpected((*buffer)->data() + region * options.region_bytes, options.region_bytes,
                   options.rank, region, step);
      if (step % 4 != 1) names.push_back(RegionName(region));
    }
    absl::StatusOr<uint64_t> bytes = (*client)->Snapshot(step, names);
    if (!bytes.ok()) return Fail(absl::StrCat("snapshot ", step), bytes.status());
    std::printf("snapshot %lld\n", static_cast<long long>(step));
    std::fflush(stdout);
    if (absl::Status status = (*client)->WaitCaptured(step); absl::IsAborted(status)) {
      // The cluster aborted the step before its capture ended (a node was lost meanwhile): its
      // regions are free again, and training goes on.
      std::printf("aborted %lld\n", static_cast<long long>(step));
      std::fflush(stdout);
      continue;
    } else if (!status.ok()) {
      return Fail(absl::StrCat("wait captured ", step), status);
    }
    std::printf("captured %lld\n", static_cast<long long>(step));
    std::fflush(stdout);
  }
  // The last step may have been skipped while earlier commits lagged: commit it for sure.
  if (absl::Status status = (*client)->Commit(options.steps); !status.ok()) {
    return Fail("commit", status);
  }
  std::printf("done %lld\n", static_cast<long long>(options.steps));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  TrainerOptions options;
  CLI::App app{"A deterministic stand-in trainer for moesnap's crash tests"};
  app.add_option("--socket", options.socket, "moesnapd agent socket")->required();
  app.add_option("--rank", options.rank, "Trainer rank");
  app.add_option("--regions", options.regions, "Number of regions")->check(CLI::Range(1, 4096));
  app.add_option("--region-bytes", options.region_bytes, "Bytes per region");
  app.add_option("--steps", options.steps, "Last step to train to");
  app.add_option("--step-ms", options.step_ms,
                 "Compute time of each step in milliseconds, before its snapshot (default 0)")
      ->check(CLI::Range(0, 60000));
  app.add_option("--mode", options.mode, "train or verify")
      ->check(CLI::IsMember({"train", "verify"}));
  CLI11_PARSE(app, argc, argv);
  return Run(options);
}
