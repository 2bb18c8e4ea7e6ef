// The etcd suite: what one step of cluster control will cost on etcd, on loopback against a real
// etcd of one member without and with fsync, and of three members with fsync:
//   - a fenced write-once decision (Client::WriteOnce under an elected leader's fence), median and
//     p99, beside a Status RPC to the same member (a gRPC round trip that touches neither raft nor
//     disk) and, with fsync, that plus one 4 KiB write + fdatasync on the filesystem of etcd's
//     data;
//   - the same decision as a watcher of the step prefix sees it (write start to event delivered);
//   - one lease keep-alive round trip (what LeaseKeeper does every third of a TTL), beside the
//   Status
//     round trip (etcd renews a lease in the leader's memory, without raft or disk).
// Samples of every figure and baseline are interleaved, so load from elsewhere hits them alike.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/suites.h"
#include "daemon/etcd/election.h"
#include "daemon/etcd/etcd_client.h"
#include "tests/testing/etcd_process.h"

namespace moesnap::bench {
namespace {

double Percentile(std::vector<double> values, double fraction) {
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(fraction * static_cast<double>(values.size() - 1))];
}

double MillisecondsSince(absl::Time start) {
  return absl::ToDoubleMilliseconds(absl::Now() - start);
}

// One 4 KiB write and fdatasync in `directory`: the disk's floor under a durable etcd write.
absl::StatusOr<double> SyncedWriteMilliseconds(const std::string& directory) {
  const std::string path = directory + "/fdatasync-probe";
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot create ", path));
  const std::string block(4096, 'x');
  const absl::Time start = absl::Now();
  const bool ok = pwrite(fd, block.data(), block.size(), 0) == static_cast<ssize_t>(block.size()) &&
                  fdatasync(fd) == 0;
  const double elapsed = MillisecondsSince(start);
  close(fd);
  if (!ok) return absl::InternalError(absl::StrCat("write + fdatasync of ", path, " failed"));
  return elapsed;
}

struct Samples {
  std::vector<double> write_once, seen_by_watcher, keep_alive, status, synced_write;
};

absl::StatusOr<Samples> Measure(int members, bool fsync, int count) {
  absl::StatusOr<std::unique_ptr<testing::EtcdCluster>> etcd =
      testing::EtcdCluster::Start({.members = members, .fsync = fsync});
  if (!etcd.ok()) return etcd.status();
  absl::StatusOr<std::unique_ptr<etcd::Client>> client =
      etcd::Client::Create((*etcd)->ClientOptions());
  if (!client.ok()) return client.status();
  absl::StatusOr<etcd::Lease> lease = (*client)->GrantLease(absl::Seconds(30));
  if (!lease.ok()) return lease.status();
  etcd::Election election(**client, "/bench/coordinator");
  absl::StatusOr<etcd::Leadership> leader =
      election.Campaign("node-0", "", lease->id, absl::Seconds(10));
  if (!leader.ok()) return leader.status();
  absl::StatusOr<int64_t> start = (*client)->Put("/bench/start", "");
  if (!start.ok()) return start.status();
  absl::StatusOr<std::unique_ptr<etcd::Watcher>> watcher =
      (*client)->WatchPrefix("/bench/step/", *start + 1);
  if (!watcher.ok()) return watcher.status();

  Samples samples;
  const int warm_up = count / 10;
  for (int step = 1; step <= warm_up + count; ++step) {
    const bool measured = step > warm_up;
    absl::Time begin = absl::Now();
    absl::StatusOr<etcd::KeyValue> decided =
        (*client)->WriteOnce(absl::StrCat("/bench/step/", step), "commit", leader->fence());
    if (!decided.ok()) return decided.status();
    const double written = MillisecondsSince(begin);
    absl::StatusOr<etcd::WatchEvent> event = (*watcher)->Next(absl::Seconds(10));
    if (!event.ok()) return event.status();
    const double seen = MillisecondsSince(begin);

    begin = absl::Now();
    absl::StatusOr<int64_t> renewed = (*client)->KeepAliveOnce(lease->id);
    if (!renewed.ok()) return renewed.status();
    const double kept = MillisecondsSince(begin);

    begin = absl::Now();
    absl::StatusOr<etcd::MemberStatus> status = (*client)->Status();
    if (!status.ok()) return status.status();
    const double answered = MillisecondsSince(begin);

    absl::StatusOr<double> synced = SyncedWriteMilliseconds((*etcd)->directory());
    if (!synced.ok()) return synced.status();
    if (!measured) continue;
    samples.write_once.push_back(written);
    samples.seen_by_watcher.push_back(seen);
    samples.keep_alive.push_back(kept);
    samples.status.push_back(answered);
    samples.synced_write.push_back(*synced);
  }
  return samples;
}

}  // namespace

absl::Status RunEtcdSuite(Report& report) {
  struct Setup {
    int members;
    bool fsync;
    int samples;  // fewer where each takes a few ms
  };
  for (const Setup setup : {Setup{1, false, 1000}, Setup{1, true, 300}, Setup{3, true, 300}}) {
    absl::StatusOr<Samples> samples = Measure(setup.members, setup.fsync, setup.samples);
    if (!samples.ok()) return samples.status();
    const std::string mode =
        absl::StrCat(setup.members, setup.members == 1 ? " member, " : " members, ",
                     setup.fsync ? "fsync" : "--unsafe-no-fsync");
    const double status = Percentile(samples->status, 0.5);
    const double synced = Percentile(samples->synced_write, 0.5);
    const double floor = setup.fsync ? status + synced : status;
    const std::string floor_name = setup.fsync ? "Status round trip + 4 KiB write+fdatasync"
                                               : "Status round trip (no raft, no disk)";
    const double write_once = Percentile(samples->write_once, 0.5);
    const double write_once_p99 = Percentile(samples->write_once, 0.99);
    const double seen = Percentile(samples->seen_by_watcher, 0.5);
    const double keep_alive = Percentile(samples->keep_alive, 0.5);
    report.Add({"etcd", absl::StrCat("fenced write-once decision, median, ", mode), write_once,
                "ms", floor_name, floor, write_once / floor});
    report.Add({"etcd", absl::StrCat("fenced write-once decision, p99, ", mode), write_once_p99,
                "ms", floor_name, floor, write_once_p99 / floor});
    report.Add({"etcd", absl::StrCat("decision seen by a watcher, median, ", mode), seen, "ms",
                "the decision's write round trip", write_once, seen / write_once});
    report.Add({"etcd", absl::StrCat("lease keep-alive round trip, median, ", mode), keep_alive,
                "ms", "Status round trip (no raft, no disk)", status, keep_alive / status});
  }
  report.AddNote(
      "etcd",
      "Real etcd members (Debian's etcd-server) on 127.0.0.1, their data on the filesystem of "
      "/tmp, "
      "and moesnap's etcd client in the benchmark's process, talking to the first member: 1000 or "
      "300 sequential steps after a tenth as many warm-up steps, each sample of every figure and "
      "baseline taken in the same step. A decision is one Txn (absent key and the leader key's "
      "create revision compared; a put, or two reads); a keep-alive is one LeaseKeepAlive stream "
      "with one request and answer. With fsync etcd syncs its WAL once per write (on every member "
      "of a quorum); the 3-member figures add the loopback round trips to the quorum.");
  return absl::OkStatus();
}

}  // namespace moesnap::bench
