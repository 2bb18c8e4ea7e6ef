// The replicas suite: N data-parallel ranks holding the same 256 MiB of state on one real daemon,
// snapshotting every step, once unsharded (each rank copies everything) and once as one replica
// group (each rank copies its 1/N shard, REFT), for N = 1, 2, 4: the bytes each rank copies per
// step and the step's capture time, beside the unsharded figures and memcpy of one copy of the
// state, all measured in the same run.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/aligned_buffer.h"
#include "bench/suites.h"
#include "common/shared_memory.h"
#include "daemon/daemon.h"
#include "moesnap/client.h"

namespace moesnap::bench {
namespace {

constexpr int kRegions = 32;
constexpr size_t kRegionBytes = 8 << 20;  // 32 x 8 MiB = 256 MiB per rank
constexpr size_t kStateBytes = kRegions * kRegionBytes;
constexpr int kThreads = 2;
constexpr int kWarmUpSteps = 2;
constexpr int kMeasuredSteps = 10;

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration duration) { return std::chrono::duration<double>(duration).count(); }

struct StepFigures {
  uint64_t bytes_per_rank = 0;  // the most any rank copied in a step
  double capture_ms = 0;        // median, from the first Snapshot to the last rank captured
};

// One daemon and `replicas` ranks of identical state, each a client as a trainer process has, the
// group declared when `sharded`; every step, all ranks snapshot at once (one thread each, as
// trainers do) and the step ends when the last has captured it.
absl::StatusOr<StepFigures> MeasureReplicas(int replicas, bool sharded) {
  const std::string directory = absl::StrCat("/tmp/moesnap-bench-replicas-", getpid());
  std::filesystem::create_directories(directory);
  daemon::DaemonOptions options;
  options.agent_socket = directory + "/agent.sock";
  options.admin_socket = directory + "/admin.sock";
  options.http.address = "";
  options.pool.name = absl::StrCat("moesnap-bench-replicas-", getpid());
  // Committed and in flight: two copies of what the ranks copy per step.
  options.pool.bytes = 2 * (sharded ? 1 : replicas) * kStateBytes + (64 << 20);
  options.pool.lock = daemon::PoolLockMode::kOff;
  options.capture.threads = kThreads;
  absl::StatusOr<StepFigures> figures = StepFigures();
  {
    absl::StatusOr<std::unique_ptr<daemon::Daemon>> daemon = daemon::Daemon::Start(options);
    if (!daemon.ok()) return daemon.status();
    std::vector<std::unique_ptr<Client>> ranks;
    std::vector<uint32_t> members;
    for (int rank = 0; rank < replicas; ++rank) members.push_back(static_cast<uint32_t>(rank));
    for (uint32_t rank : members) {
      absl::StatusOr<std::unique_ptr<Client>> client =
          Client::Connect({.socket_path = options.agent_socket, .rank = rank});
      if (!client.ok()) return client.status();
      absl::StatusOr<std::shared_ptr<SharedBuffer>> state = (*client)->AllocateHost(kStateBytes);
      if (!state.ok()) return state.status();
      std::memset((*state)->data(), 0x3c, kStateBytes);  // the same bytes on every replica
      for (int region = 0; region < kRegions; ++region) {
        if (absl::Status status = (*client)->RegisterHostRegion(
                {absl::StrCat("layer", region), "float32", {}}, *state, region * kRegionBytes,
                kRegionBytes);
            !status.ok()) {
          return status;
        }
      }
      if (sharded) {
        if (absl::Status status = (*client)->SetReplicaGroup({"data-parallel", members});
            !status.ok()) {
          return status;
        }
      }
      ranks.push_back(*std::move(client));
    }
    std::vector<double> capture_ms;
    for (int step = 1; step <= kWarmUpSteps + kMeasuredSteps && figures.ok(); ++step) {
      std::vector<absl::StatusOr<uint64_t>> copied(ranks.size(), uint64_t{0});
      const Clock::time_point start = Clock::now();
      std::vector<std::thread> trainers;
      for (size_t rank = 0; rank < ranks.size(); ++rank) {
        trainers.emplace_back([&, rank] {
          copied[rank] = ranks[rank]->Snapshot(step);
          if (copied[rank].ok()) {
            if (absl::Status status = ranks[rank]->WaitCaptured(step); !status.ok()) {
              copied[rank] = status;
            }
          }
        });
      }
      for (std::thread& trainer : trainers) trainer.join();
      const double elapsed_ms = Seconds(Clock::now() - start) * 1e3;
      for (const absl::StatusOr<uint64_t>& bytes : copied) {
        if (!bytes.ok()) {
          figures = bytes.status();
          break;
        }
        figures->bytes_per_rank = std::max(figures->bytes_per_rank, *bytes);
      }
      if (step > kWarmUpSteps) capture_ms.push_back(elapsed_ms);
      // The next step's copies must find room: this one commits first (with every shard).
      for (const auto& rank : ranks) {
        if (absl::Status status = rank->WaitCommitted(step); !status.ok() && figures.ok()) {
          figures = status;
        }
      }
    }
    if (figures.ok()) {
      std::sort(capture_ms.begin(), capture_ms.end());
      figures->capture_ms = capture_ms[capture_ms.size() / 2];
    }
  }
  std::filesystem::remove_all(directory);
  for (const char* suffix : {".data", ".journal"}) {
    SharedMemory::Unlink(options.pool.name + suffix).IgnoreError();
  }
  return figures;
}

// memcpy of one copy of the state by the daemon's number of threads: what a group's step must
// move at the least, whatever N.
double BestCopyMilliseconds() {
  AlignedBuffer source(kStateBytes, 0x3c);
  AlignedBuffer destination(kStateBytes, 1);
  double best = 1e9;
  for (int round = 0; round < 5; ++round) {
    const Clock::time_point start = Clock::now();
    std::vector<std::thread> workers;
    const size_t share = kStateBytes / kThreads;
    for (int t = 0; t < kThreads; ++t) {
      workers.emplace_back([&, t] {
        std::memcpy(destination.data() + t * share, source.data() + t * share, share);
      });
    }
    for (std::thread& worker : workers) worker.join();
    best = std::min(best, Seconds(Clock::now() - start) * 1e3);
  }
  return best;
}

}  // namespace

absl::Status RunReplicaSuite(Report& report) {
  const double copy_ms = BestCopyMilliseconds();
  for (int replicas : {1, 2, 4}) {
    absl::StatusOr<StepFigures> whole = MeasureReplicas(replicas, /*sharded=*/false);
    if (!whole.ok()) return whole.status();
    absl::StatusOr<StepFigures> sharded = MeasureReplicas(replicas, /*sharded=*/true);
    if (!sharded.ok()) return sharded.status();
    const std::string n = absl::StrCat("N = ", replicas, ": ");
    const double mib = 1 << 20;
    report.Add({"replicas", n + "bytes copied per rank per step, one shard each",
                sharded->bytes_per_rank / mib, "MiB", "unsharded, each rank all",
                whole->bytes_per_rank / mib,
                static_cast<double>(sharded->bytes_per_rank) / whole->bytes_per_rank});
    report.Add({"replicas", n + "capture of the step, one shard each", sharded->capture_ms, "ms",
                "unsharded, each rank all", whole->capture_ms,
                sharded->capture_ms / whole->capture_ms});
    report.Add({"replicas", n + "capture of the step, one shard each", sharded->capture_ms, "ms",
                "memcpy of one copy, 2 threads", copy_ms, copy_ms / sharded->capture_ms});
  }
  report.AddNote("replicas", absl::StrCat(
      "N ranks of one real moesnapd (in the benchmark's process, over its Unix socket) hold the "
      "same ", kStateBytes >> 20, " MiB (", kRegions, " regions) and snapshot every step at once, "
      "unsharded, then as one replica group; ", kMeasuredSteps, " measured steps after ",
      kWarmUpSteps, " warm-up steps, medians; a step's capture runs from the first Snapshot to the "
      "last rank captured, on the daemon's ", kThreads, " capture threads with CRC-32C."));
  return absl::OkStatus();
}

}  // namespace moesnap::bench
