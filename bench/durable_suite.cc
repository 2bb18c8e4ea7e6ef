// The durable suite: a real daemon (in this process) drains committed steps of 512 MiB to a
// directory on the machine's disk, compared with a plain sequential write of the same bytes to
// the same directory and with torch.save of a state of the same size there (both synced, as the
// drain is); and what the trainer feels of a drain: its blocking time in Snapshot() and the time
// its capture takes, during a drain against without one.
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "bench/aligned_buffer.h"
#include "bench/suites.h"
#include "daemon/daemon.h"
#include "moesnap/client.h"
#include "proto/moesnap.grpc.pb.h"

namespace moesnap::bench {
namespace {

constexpr int kRegions = 16;
constexpr size_t kRegionBytes = 32 << 20;  // 16 x 32 MiB = 512 MiB
constexpr size_t kStateBytes = kRegions * kRegionBytes;
constexpr int kDrains = 5;
constexpr int kStallSteps = 24;  // steps timed, alternately with and without a drain running

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration duration) { return std::chrono::duration<double>(duration).count(); }

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[values.size() / 2];
}

// "0.71-1.20": the spread of the repetitions, for the note.
std::string Spread(const std::vector<double>& values) {
  const auto [low, high] = std::minmax_element(values.begin(), values.end());
  return absl::StrFormat("%.2f-%.2f", *low, *high);
}

// write() of `bytes` in 4 MiB pieces into a new file, then fdatasync: what any writer of the same
// bytes to the same directory pays. With `early_writeback`, writeback of every 64 MiB written is
// started at once (sync_file_range), as the drain does, so that writing and flushing overlap.
absl::StatusOr<double> SequentialWrite(const std::string& directory, const uint8_t* bytes,
                                       size_t length, bool early_writeback) {
  const std::string path = directory + "/sequential.bin";
  const Clock::time_point start = Clock::now();
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot create ", path));
  for (size_t offset = 0; offset < length; offset += 4 << 20) {
    const size_t piece = std::min<size_t>(4 << 20, length - offset);
    if (write(fd, bytes + offset, piece) != static_cast<ssize_t>(piece)) {
      close(fd);
      return absl::UnavailableError(absl::StrCat("cannot write ", path));
    }
    if (early_writeback && (offset + piece) % (64 << 20) == 0) {
      sync_file_range(fd, static_cast<off_t>(offset + piece - (64 << 20)), 64 << 20,
                      SYNC_FILE_RANGE_WRITE);
    }
  }
  fdatasync(fd);
  close(fd);
  const double seconds = Seconds(Clock::now() - start);
  std::filesystem::remove(path);
  return seconds;
}

absl::StatusOr<double> TorchSave(const std::string& directory) {
  if (access(MOESNAP_PYTHON, X_OK) != 0) {
    return absl::UnavailableError(absl::StrCat(MOESNAP_PYTHON, " (with torch) is not installed"));
  }
  const std::string command = absl::StrCat(MOESNAP_PYTHON, " ", MOESNAP_SOURCE_DIR,
                                           "/bench/torch_save.py --bytes ", kStateBytes,
                                           " --tensors ", kRegions, " --directory ", directory);
  FILE* output = popen(command.c_str(), "r");
  if (output == nullptr) return absl::InternalError("cannot run bench/torch_save.py");
  char line[256];
  double seconds = 0;
  while (fgets(line, sizeof(line), output) != nullptr) {
    absl::string_view text = absl::StripTrailingAsciiWhitespace(line);
    if (absl::ConsumePrefix(&text, "seconds|")) (void)absl::SimpleAtod(text, &seconds);
  }
  if (pclose(output) != 0 || seconds <= 0) return absl::InternalError("bench/torch_save.py failed");
  return seconds;
}

class DurableBench {
 public:
  absl::Status Run(Report& report);

 private:
  v1::DurableStatus Durable() {
    grpc::ClientContext context;
    v1::StatusResponse response;
    admin_->Status(&context, {}, &response);
    return response.durable();
  }
  absl::Status WaitIdle() {
    for (int attempt = 0; attempt < 6000; ++attempt) {
      if (!Durable().has_draining_step()) return absl::OkStatus();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return absl::DeadlineExceededError("a drain did not finish in 60 s");
  }
  // One step: Snapshot (its blocking time) and WaitCaptured (the capture's time).
  absl::Status Step(int64_t step, double* blocked, double* captured) {
    const Clock::time_point start = Clock::now();
    absl::StatusOr<uint64_t> bytes = client_->Snapshot(step);
    const Clock::time_point returned = Clock::now();
    if (!bytes.ok()) return bytes.status();
    if (absl::Status status = client_->WaitCaptured(step); !status.ok()) return status;
    if (absl::Status status = client_->WaitCommitted(step); !status.ok()) return status;
    *blocked = Seconds(returned - start) * 1e3;
    *captured = Seconds(Clock::now() - start) * 1e3;
    return absl::OkStatus();
  }

  std::unique_ptr<Client> client_;
  std::unique_ptr<v1::Admin::Stub> admin_;
};

absl::Status DurableBench::Run(Report& report) {
  const std::string run = absl::StrCat("/tmp/moesnap-bench-durable-", getpid());
  // On the machine's disk, where a drain would write (not a tmpfs such as /dev/shm).
  const std::string disk = absl::StrCat("/var/tmp/moesnap-bench-durable-", getpid());
  std::filesystem::create_directories(run);
  std::filesystem::create_directories(disk);
  daemon::DaemonOptions options;
  options.agent_socket = run + "/agent.sock";
  options.admin_socket = run + "/admin.sock";
  options.pool.name = absl::StrCat("moesnap-bench-durable-", getpid());
  options.pool.bytes = 3 * kStateBytes + (64 << 20);  // committed, in flight, held by a drain
  options.pool.journal_bytes = 1 << 20;
  options.pool.lock = daemon::PoolLockMode::kOff;
  options.durable.directory = disk;
  options.durable.every_steps = 2;  // even steps drain, odd ones do not
  options.durable.keep = 1;
  absl::Status status;
  {
    absl::StatusOr<std::unique_ptr<daemon::Daemon>> daemon = daemon::Daemon::Start(options);
    if (!daemon.ok()) return daemon.status();
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.socket_path = options.agent_socket, .rank = 0});
    if (!client.ok()) return client.status();
    client_ = *std::move(client);
    admin_ = v1::Admin::NewStub(grpc::CreateChannel("unix:" + options.admin_socket,
                                                    grpc::InsecureChannelCredentials()));
    absl::StatusOr<std::shared_ptr<SharedBuffer>> state = client_->AllocateHost(kStateBytes);
    if (!state.ok()) return state.status();
    for (size_t i = 0; i < kStateBytes; i += 4096) (*state)->data()[i] = static_cast<uint8_t>(i >> 12);
    for (int region = 0; region < kRegions; ++region) {
      status.Update(client_->RegisterHostRegion({absl::StrCat("expert", region), "float32", {}},
                                                *state, region * kRegionBytes, kRegionBytes));
    }
    if (!status.ok()) return status;

    // Drain throughput: each even step drains whole before the next step starts. The first step
    // committed after the start is due too: it drains first, untimed.
    std::vector<double> drain_rates, write_rates, overlapped_rates;
    int64_t step = 0;
    double blocked = 0, captured = 0;
    if (absl::Status s = Step(++step, &blocked, &captured); !s.ok()) return s;
    if (absl::Status s = WaitIdle(); !s.ok()) return s;
    for (int drain = 0; drain < kDrains; ++drain) {
      do {  // up to the next even step, which is due
        if (absl::Status s = Step(++step, &blocked, &captured); !s.ok()) return s;
      } while (step % 2 != 0);
      if (absl::Status s = WaitIdle(); !s.ok()) return s;
      const v1::DurableStatus durable = Durable();
      if (durable.latest_step() != step || durable.last_drain_seconds() <= 0) {
        return absl::InternalError(absl::StrCat("step ", step, " was not drained: ",
                                                durable.last_error()));
      }
      drain_rates.push_back(static_cast<double>(kStateBytes) / durable.last_drain_seconds() / 1e9);
      absl::StatusOr<double> written = SequentialWrite(disk, (*state)->data(), kStateBytes, false);
      if (!written.ok()) return written.status();
      write_rates.push_back(static_cast<double>(kStateBytes) / *written / 1e9);
      written = SequentialWrite(disk, (*state)->data(), kStateBytes, true);
      if (!written.ok()) return written.status();
      overlapped_rates.push_back(static_cast<double>(kStateBytes) / *written / 1e9);
    }
    const double drain = Median(drain_rates);
    report.Add({"durable", "drain of a committed step, 512 MiB (+CRC check, fsync)", drain, "GB/s",
                "sequential write + fdatasync of the same bytes, same directory",
                Median(write_rates), drain / Median(write_rates)});
    report.Add({"durable", "drain of a committed step, 512 MiB (+CRC check, fsync)", drain, "GB/s",
                "the same write with writeback started every 64 MiB, as the drain does",
                Median(overlapped_rates), drain / Median(overlapped_rates)});
    absl::StatusOr<double> saved = TorchSave(disk);
    if (saved.ok()) {
      const double rate = static_cast<double>(kStateBytes) / *saved / 1e9;
      report.Add({"durable", "drain of a committed step, 512 MiB (+CRC check, fsync)", drain, "GB/s",
                  "torch.save + fsync of a 512 MiB state, same directory", rate, drain / rate});
    } else if (!absl::IsUnavailable(saved.status())) {
      return saved.status();
    }

    // The trainer during a drain: steps run back to back; an even step starts a drain that the
    // next steps overlap. Steps are sorted by whether a drain was running when they began.
    std::vector<double> blocked_draining, blocked_idle, captured_draining, captured_idle;
    for (int i = 0; i < kStallSteps; ++i) {
      const bool draining = Durable().has_draining_step();
      if (absl::Status s = Step(++step, &blocked, &captured); !s.ok()) return s;
      (draining ? blocked_draining : blocked_idle).push_back(blocked);
      (draining ? captured_draining : captured_idle).push_back(captured);
      if (!draining && step % 2 == 1) {
        if (absl::Status s = WaitIdle(); !s.ok()) return s;  // some steps without a drain too
      }
    }
    if (blocked_draining.empty() || blocked_idle.empty()) {
      return absl::InternalError("no step ran during a drain (or none without one)");
    }
    report.Add({"durable", "trainer blocked in Snapshot() during a drain, median",
                Median(blocked_draining), "ms", "the same without a drain", Median(blocked_idle),
                Median(blocked_draining) / Median(blocked_idle)});
    report.Add({"durable", "capture + commit of a 512 MiB step during a drain, median",
                Median(captured_draining), "ms", "the same without a drain", Median(captured_idle),
                Median(captured_draining) / Median(captured_idle)});
    report.AddNote("durable", absl::StrCat(
        "A real moesnapd in the benchmark's process, 16 regions of 32 MiB, [durable] every 2 steps "
        "to /var/tmp (the machine's disk). Drain: medians of ", kDrains, " drains from the pool "
        "(every chunk's CRC-32C checked on the way, data files and manifest fdatasync'ed, one "
        "rename), each beside two writes of the same bytes just after it: plain (flushed whole by "
        "the final fdatasync) and with writeback started every 64 MiB as the drain does it; spread "
        "of the repetitions in GB/s: drain ", Spread(drain_rates), ", plain write ",
        Spread(write_rates), ", early writeback ", Spread(overlapped_rates), ". Trainer: ",
        kStallSteps, " steps back to back, split by whether a drain was running when the step began "
        "(", blocked_draining.size(), " did, ", blocked_idle.size(), " did not)."));
  }
  for (const char* suffix : {".data", ".journal"}) {
    std::filesystem::remove("/dev/shm/" + options.pool.name + suffix);
  }
  std::filesystem::remove_all(run);
  std::filesystem::remove_all(disk);
  return status;
}

}  // namespace

absl::Status RunDurableSuite(Report& report) {
  DurableBench bench;
  return bench.Run(report);
}

}  // namespace moesnap::bench
