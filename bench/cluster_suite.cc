// The cluster suite: real moesnapd daemons (in this process, each with its own pool, sockets, Peer
// service and data plane on loopback) and a trainer rank per node.
//   - A committed step on 3, 6 and 12 nodes, dense and sparse: from the ranks' Snapshot calls,
//     each rank on its own thread, to the last rank's WaitCommitted. Its limit: copying the
//     node's bytes once (memcpy) plus sending m copies of them over a raw TCP stream, both
//     measured in this run.
//   - A dense and a sparse step of 3 nodes holding 16,384 tensors of 4 KiB each, beside the
//     same bytes held as 16 tensors: what a step costs per tensor.
//   - Rebuild of a node of a (4, 2) group from the survivors, against raw TCP for the bytes fetched
//     plus a raw Reed-Solomon decode of them.
//   - Memory per node for two-loss protection: data + parity against replication x3.
//   - Control cost of a step on 3, 6, 12 and 24 nodes with tiny state (one 64 KiB region per node,
//     tiny pools): etcd writes per step as etcd's own counters show them (mvcc puts and deletes,
//     raft proposals), beside the one decision a step needs; Peer calls per step per node beside
//     a proposal and an encode; lease keep-alives per node per TTL as etcd's leader counts them, beside
//     one every third of a TTL; the commit latency, beside one fenced write of etcd measured in the
//     same run.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <latch>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/aligned_buffer.h"
#include "common/loopback_port.h"
#include "bench/raw_tcp.h"
#include "bench/suites.h"
#include "bench/timing.h"
#include "common/log.h"
#include "daemon/daemon.h"
#include "erasure/reed_solomon.h"
#include "moesnap/client.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "daemon/etcd/etcd_client.h"
#include "proto/moesnap.grpc.pb.h"
#include "tests/testing/etcd_process.h"
#include "tests/testing/http_client.h"
#include "tests/testing/huge_pages.h"

namespace moesnap::bench {
namespace {

constexpr size_t kRegionBytes = 4 << 20;
constexpr int kRegionsPerNode = 8;  // 32 MiB of trainer state per node
constexpr size_t kNodeBytes = kRegionBytes * kRegionsPerNode;
constexpr int kStepsOfEachKind = 20;  // dense, then sparse: the median of each counts
constexpr size_t kChunkBytes = 4 << 20;
constexpr uint32_t kControlLeaseMs = 5000;  // every benchmark cluster's lease TTL

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration duration) { return std::chrono::duration<double>(duration).count(); }

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// What each node of a benchmark cluster holds: `regions` trainer regions of `region_bytes`.
struct Sizes {
  size_t region_bytes = kRegionBytes;
  int regions = kRegionsPerNode;
  uint64_t stripe_unit_bytes = 4 << 20;
  // Committed + captured + parity (m/k of the data, rounded up per stripe) + a rebuild's copy.
  uint64_t pool_bytes = 4 * kNodeBytes + (16 << 20);
  // Each commit journals every group member's image, a record per region.
  uint64_t journal_bytes = 1 << 20;
  int capture_threads = 2;
  size_t node_bytes() const { return region_bytes * static_cast<size_t>(regions); }
};

// Control-cost clusters: 64 KiB per node, so that 24 daemons fit a small machine.
constexpr Sizes kTinySizes{.region_bytes = 64 << 10,
                           .regions = 1,
                           .stripe_unit_bytes = 64 << 10,
                           .pool_bytes = 4 << 20,
                           .capture_threads = 1};

// N daemons of one cluster (a job of their own on `etcd`) and a trainer rank on each, all in this
// process.
class LoopbackCluster {
 public:
  static absl::StatusOr<std::unique_ptr<LoopbackCluster>> Start(const testing::EtcdCluster& etcd,
                                                                int nodes, int k, int m,
                                                                const Sizes& sizes = {}) {
    auto cluster = std::unique_ptr<LoopbackCluster>(new LoopbackCluster());
    cluster->sizes_ = sizes;
    cluster->directory_ = absl::StrCat("/tmp/moesnap-bench-cluster-", getpid());
    std::filesystem::create_directories(cluster->directory_);
    daemon::ClusterOptions shape;
    static int jobs = 0;
    shape.job = absl::StrCat("bench-", getpid(), "-", jobs++);
    shape.node_count = nodes;
    shape.data_units = k;
    shape.parity_units = m;
    shape.stripe_unit_bytes = sizes.stripe_unit_bytes;
    shape.lease_ttl_ms = kControlLeaseMs;
    shape.commit_timeout_ms = 60000;
    shape.etcd_endpoints = etcd.endpoints();
    shape.advertise_host = "127.0.0.1";
    shape.tls.insecure = true;  // daemons of one process on loopback; `dataplane` measures TLS
    shape.control_port = 0;
    shape.data_port = 0;
    for (int id = 0; id < nodes; ++id) {
      daemon::DaemonOptions options;
      options.node_id = id;
      options.agent_socket = absl::StrCat(cluster->directory_, "/agent", id, ".sock");
      options.admin_socket = absl::StrCat(cluster->directory_, "/admin", id, ".sock");
      options.http.address = "";  // six daemons in one process: none serves metrics
      options.pool.name = absl::StrCat("moesnap-bench-cluster-", getpid(), "-", id);
      options.pool.bytes = sizes.pool_bytes;
      options.pool.journal_bytes = sizes.journal_bytes;
      options.pool.lock = daemon::PoolLockMode::kOff;
      options.capture.threads = sizes.capture_threads;
      options.cluster = shape;
      if (absl::Status status = options.cluster->Validate(id); !status.ok()) return status;
      cluster->pools_.push_back(options.pool.name);
      absl::StatusOr<std::unique_ptr<daemon::Daemon>> started = daemon::Daemon::Start(options);
      if (!started.ok()) return started.status();
      cluster->daemons_.push_back(*std::move(started));
      cluster->admins_.push_back(v1::Admin::NewStub(grpc::CreateChannel(
          "unix:" + options.admin_socket, grpc::InsecureChannelCredentials())));
    }
    if (absl::Status status = cluster->WaitSettled(); !status.ok()) return status;
    for (int id = 0; id < nodes; ++id) {
      absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(
          {.socket_path = absl::StrCat(cluster->directory_, "/agent", id, ".sock"),
           .rank = static_cast<uint32_t>(id)});
      if (!client.ok()) return client.status();
      absl::StatusOr<std::shared_ptr<SharedBuffer>> state =
          (*client)->AllocateHost(sizes.node_bytes());
      if (!state.ok()) return state.status();
      std::memset((*state)->data(), id + 1, sizes.node_bytes());
      if (absl::Status status = RegisterAll(**client, **state, sizes); !status.ok()) {
        return status;
      }
      cluster->clients_.push_back(*std::move(client));
      cluster->states_.push_back(*std::move(state));
    }
    return cluster;
  }

  ~LoopbackCluster() {
    clients_.clear();
    states_.clear();
    daemons_.clear();
    for (const std::string& pool : pools_) {
      for (const char* suffix : {".data", ".journal"}) {
        std::filesystem::remove("/dev/shm/" + pool + suffix);
      }
    }
    std::filesystem::remove_all(directory_);
  }

  // Changes `regions` of every node (all when empty), snapshots them as `step` everywhere and waits
  // until every node committed it; returns the seconds that took.
  absl::StatusOr<double> CommitStep(int64_t step, const std::vector<int>& regions) {
    std::vector<std::string> names;
    for (int region : regions) names.push_back(absl::StrCat("expert", region));
    for (size_t node = 0; node < clients_.size(); ++node) {
      for (int region = 0; region < sizes_.regions; ++region) {
        if (regions.empty() || std::find(regions.begin(), regions.end(), region) != regions.end()) {
          states_[node]->data()[region * sizes_.region_bytes + step % 4096] ^= 0xff;
        }
      }
    }
    // Each rank snapshots and waits for the commit on its own thread, as a job's trainer
    // processes do; the step ends when the last rank's WaitCommitted returns.
    std::vector<absl::Status> statuses(clients_.size());
    std::latch go(1);
    std::vector<std::thread> ranks;
    for (size_t node = 0; node < clients_.size(); ++node) {
      ranks.emplace_back([&, node] {
        go.wait();
        const absl::StatusOr<uint64_t> bytes = clients_[node]->Snapshot(step, names);
        statuses[node] = bytes.ok() ? clients_[node]->WaitCommitted(step) : bytes.status();
      });
    }
    const Clock::time_point start = Clock::now();
    go.count_down();
    for (std::thread& rank : ranks) rank.join();
    const double seconds = Seconds(Clock::now() - start);
    for (const absl::Status& status : statuses) {
      if (!status.ok()) return status;
    }
    return seconds;
  }

  absl::StatusOr<v1::ClusterStatusResponse> Status(int node) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ClusterStatusResponse response;
    const grpc::Status status = admins_[node]->ClusterStatus(&context, {}, &response);
    if (!status.ok()) return absl::UnavailableError(status.error_message());
    return response;
  }

  absl::StatusOr<v1::RebuildResponse> Rebuild(int node) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
    v1::RebuildRequest request;
    request.set_node_id(node);
    v1::RebuildResponse response;
    const grpc::Status status = admins_[node]->Rebuild(&context, request, &response);
    if (!status.ok()) return absl::InternalError(status.error_message());
    return response;
  }

  size_t nodes() const { return daemons_.size(); }

  // Loses `node` for good: its daemon stops and its memory is deleted.
  void Lose(int node) {
    clients_[node].reset();
    daemons_[node].reset();
    for (const char* suffix : {".data", ".journal"}) {
      std::filesystem::remove("/dev/shm/" + pools_[node] + suffix);
    }
  }

  // Restores every region of `source_rank` into a new rank on `node`, in one call, into memory of
  // `pages`; returns seconds.
  absl::StatusOr<double> RestoreRankElsewhere(
      int node, uint32_t source_rank, uint32_t new_rank,
      SharedBuffer::Pages pages = SharedBuffer::Pages::kOrdinary) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(
        {.socket_path = absl::StrCat(directory_, "/agent", node, ".sock"), .rank = new_rank});
    if (!client.ok()) return client.status();
    absl::StatusOr<std::shared_ptr<SharedBuffer>> state =
        AllocateRestored(sizes_.node_bytes(), pages);
    if (!state.ok()) return state.status();
    if (absl::Status status = RegisterAll(**client, **state, sizes_); !status.ok()) return status;
    std::vector<std::string> names;
    for (int region = 0; region < sizes_.regions; ++region) {
      names.push_back(absl::StrCat("expert", region));
    }
    const Clock::time_point start = Clock::now();
    absl::StatusOr<RestoreResult> restored = (*client)->RestoreFrom(source_rank, names);
    if (!restored.ok()) return restored.status();
    return Seconds(Clock::now() - start);
  }

  // Restores region `expert<region>` of `source_rank` into a new rank on `node`, into memory of
  // `pages`; returns seconds.
  absl::StatusOr<double> RestoreElsewhere(
      int node, uint32_t source_rank, int region, uint32_t new_rank,
      SharedBuffer::Pages pages = SharedBuffer::Pages::kOrdinary) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(
        {.socket_path = absl::StrCat(directory_, "/agent", node, ".sock"), .rank = new_rank});
    if (!client.ok()) return client.status();
    absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer =
        AllocateRestored(sizes_.region_bytes, pages);
    if (!buffer.ok()) return buffer.status();
    const std::string name = absl::StrCat("expert", region);
    if (absl::Status status = (*client)->RegisterHostRegion({name, "float32", {}}, *buffer, 0,
                                                            sizes_.region_bytes);
        !status.ok()) {
      return status;
    }
    const Clock::time_point start = Clock::now();
    absl::StatusOr<RestoreResult> restored = (*client)->RestoreFrom(source_rank, {name});
    if (!restored.ok()) return restored.status();
    return Seconds(Clock::now() - start);
  }

 private:
  LoopbackCluster() = default;

  // A new rank's memory for a restore, in `pages`: an error when huge pages were asked for and
  // not had, so that no figure is labelled with pages it did not use.
  static absl::StatusOr<std::shared_ptr<SharedBuffer>> AllocateRestored(size_t bytes,
                                                                       SharedBuffer::Pages pages) {
    absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer =
        SharedBuffer::Allocate(bytes, SharedBuffer::kRegionFile, pages);
    if (buffer.ok() && pages == SharedBuffer::Pages::kHuge &&
        (*buffer)->page_bytes() != testing::HugePageReservation::PageBytes()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("a restore's ", bytes, " bytes got no huge pages"));
    }
    return buffer;
  }

  // Registers `sizes.regions` regions `expert<i>` back to back in `state`, in one call.
  static absl::Status RegisterAll(Client& client, const SharedBuffer& state, const Sizes& sizes) {
    absl::StatusOr<std::vector<MemoryHandle>> memory = client.ShareMemory({state.fd()});
    if (!memory.ok()) return memory.status();
    std::vector<HostRegion> regions;
    for (int region = 0; region < sizes.regions; ++region) {
      regions.push_back({{absl::StrCat("expert", region), "float32", {}},
                         memory->front(),
                         region * sizes.region_bytes,
                         sizes.region_bytes});
    }
    return client.RegisterHostRegions(regions);
  }

  absl::Status WaitSettled() {
    for (int attempt = 0; attempt < 200; ++attempt) {
      bool settled = true;
      for (size_t node = 0; node < daemons_.size() && settled; ++node) {
        absl::StatusOr<v1::ClusterStatusResponse> status = Status(static_cast<int>(node));
        if (!status.ok()) return status.status();
        for (const v1::ClusterNodeStatus& peer : status->nodes()) {
          settled = settled && peer.live() && peer.answered() && !peer.rebuilding();
        }
      }
      if (settled) return absl::OkStatus();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return absl::DeadlineExceededError("the benchmark cluster did not settle");
  }

  Sizes sizes_;
  std::string directory_;
  std::vector<std::string> pools_;
  std::vector<std::unique_ptr<daemon::Daemon>> daemons_;
  std::vector<std::unique_ptr<v1::Admin::Stub>> admins_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::shared_ptr<SharedBuffer>> states_;
};

// etcd's own counters, read from its /metrics: writes to its key space and raft entries.
struct EtcdCounters {
  double puts = 0;        // etcd_mvcc_put_total (puts, in Txns too)
  double deletes = 0;     // etcd_mvcc_delete_total
  double proposals = 0;   // etcd_server_proposals_committed_total (every write RPC, lease grants)
  double renewals = 0;    // etcd_debugging_lease_renewed_total (keep-alives the leader served)
};

absl::StatusOr<EtcdCounters> ReadEtcdCounters(const std::string& endpoint) {
  uint32_t port = 0;
  if (!absl::SimpleAtoi(endpoint.substr(endpoint.rfind(':') + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("no port in etcd endpoint ", endpoint));
  }
  absl::StatusOr<testing::HttpReply> reply =
      testing::HttpGet(static_cast<uint16_t>(port), "/metrics");
  if (!reply.ok()) return reply.status();
  EtcdCounters counters;
  const std::vector<std::pair<std::string, double*>> wanted = {
      {"etcd_mvcc_put_total", &counters.puts},
      {"etcd_mvcc_delete_total", &counters.deletes},
      {"etcd_server_proposals_committed_total", &counters.proposals},
      {"etcd_debugging_lease_renewed_total", &counters.renewals}};
  int found = 0;
  for (absl::string_view line : absl::StrSplit(reply->body, '\n')) {
    for (const auto& [name, value] : wanted) {
      const std::vector<absl::string_view> fields = absl::StrSplit(line, ' ');
      if (fields.size() == 2 && fields[0] == name && absl::SimpleAtod(fields[1], value)) ++found;
    }
  }
  if (found != static_cast<int>(wanted.size())) {
    return absl::NotFoundError(absl::StrCat("etcd's /metrics at ", endpoint, " lacks ",
                                            wanted.size() - found, " of the counters read"));
  }
  return counters;
}

// What one committed step costs the control plane at one cluster size.
struct ControlCost {
  double kv_writes = 0;        // etcd's puts + deletes per step
  double proposals = 0;        // etcd's raft entries per step
  double client_writes = 0;    // etcd writes per step as the daemons count them
  double peer_calls = 0;       // Peer calls per step per node
  double renewals = 0;         // keep-alives per node per lease TTL
  double commit_ms = 0;        // median commit latency of a step
};

constexpr int kControlSteps = 20;

absl::StatusOr<ControlCost> MeasureControl(const testing::EtcdCluster& etcd, int nodes) {
  const int k = nodes == 3 ? 2 : 4;
  const int m = nodes == 3 ? 1 : 2;
  absl::StatusOr<std::unique_ptr<LoopbackCluster>> cluster =
      LoopbackCluster::Start(etcd, nodes, k, m, kTinySizes);
  if (!cluster.ok()) return cluster.status();
  // The first step encodes whole and elects nothing new; counting starts after it.
  if (absl::StatusOr<double> first = (*cluster)->CommitStep(1, {}); !first.ok()) {
    return first.status();
  }
  auto daemon_counters = [&]() -> absl::StatusOr<std::pair<double, double>> {
    double peer_calls = 0, writes = 0;
    for (int node = 0; node < nodes; ++node) {
      absl::StatusOr<v1::ClusterStatusResponse> status = (*cluster)->Status(node);
      if (!status.ok()) return status.status();
      peer_calls += static_cast<double>(status->peer_calls());
      writes += static_cast<double>(status->etcd_writes());
    }
    return std::pair{peer_calls, writes};
  };
  absl::StatusOr<EtcdCounters> etcd_before = ReadEtcdCounters(etcd.endpoint(0));
  if (!etcd_before.ok()) return etcd_before.status();
  // Answering ClusterStatus makes Peer calls of its own: the cost of one round of reading is
  // measured and taken off.
  absl::StatusOr<std::pair<double, double>> first_read = daemon_counters();
  if (!first_read.ok()) return first_read.status();
  absl::StatusOr<std::pair<double, double>> before = daemon_counters();
  if (!before.ok()) return before.status();
  const double reading_calls = before->first - first_read->first;
  std::vector<double> latencies;
  for (int step = 2; step < 2 + kControlSteps; ++step) {
    absl::StatusOr<double> seconds = (*cluster)->CommitStep(step, {});
    if (!seconds.ok()) return seconds.status();
    latencies.push_back(*seconds * 1e3);
  }
  absl::StatusOr<EtcdCounters> etcd_after = ReadEtcdCounters(etcd.endpoint(0));
  if (!etcd_after.ok()) return etcd_after.status();
  absl::StatusOr<std::pair<double, double>> after = daemon_counters();
  if (!after.ok()) return after.status();
  // Keep-alives come every third of a TTL whatever the steps do: counted over one whole TTL.
  const Clock::time_point renewals_start = Clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(kControlLeaseMs));
  absl::StatusOr<EtcdCounters> renewals_after = ReadEtcdCounters(etcd.endpoint(0));
  if (!renewals_after.ok()) return renewals_after.status();
  const double ttls = Seconds(Clock::now() - renewals_start) / (kControlLeaseMs / 1e3);
  return ControlCost{
      .kv_writes = (etcd_after->puts + etcd_after->deletes - etcd_before->puts -
                    etcd_before->deletes) / kControlSteps,
      .proposals = (etcd_after->proposals - etcd_before->proposals) / kControlSteps,
      .client_writes = (after->second - before->second) / kControlSteps,
      .peer_calls = (after->first - before->first - reading_calls) / kControlSteps / nodes,
      .renewals = (renewals_after->renewals - etcd_after->renewals) / nodes / ttls,
      .commit_ms = Median(latencies)};
}

// The median round trip of one etcd write (a Put) on `etcd`: the floor under a step's decision.
absl::StatusOr<double> EtcdPutMilliseconds(const testing::EtcdCluster& etcd) {
  absl::StatusOr<std::unique_ptr<etcd::Client>> client = etcd::Client::Create(etcd.ClientOptions());
  if (!client.ok()) return client.status();
  std::vector<double> samples;
  for (int i = 0; i < 20; ++i) {
    const Clock::time_point start = Clock::now();
    if (absl::StatusOr<int64_t> put = (*client)->Put("/moesnap-bench/probe", std::to_string(i));
        !put.ok()) {
      return put.status();
    }
    samples.push_back(Seconds(Clock::now() - start) * 1e3);
  }
  return Median(samples);
}

struct Limits {
  double memcpy_gbps = 0;
  double tcp_gbps = 0;
};

Limits MeasureLimits() {
  AlignedBuffer source(kNodeBytes, 0x5a);
  AlignedBuffer destination(kNodeBytes, 0);
  RawTcpStream raw(kChunkBytes);
  const Comparison limits = CompareGigabytesPerSecond(
      [&] { std::memcpy(destination.data(), source.data(), kNodeBytes); },
      [&] { raw.Send(source.data(), static_cast<int>(kNodeBytes / kChunkBytes)); }, kNodeBytes,
      {.min_seconds_per_repetition = 0.2, .repetitions = 3});
  return {limits.value, limits.baseline};
}

// The pause before each timed restore, while the restoring rank's client connects and registers its
// region (4.5 to 6 ms here): the raw fetch a restore stands beside pauses as long.
constexpr std::chrono::microseconds kIdleBeforeRestore{5000};

// The median seconds of a raw TCP fetch of `bytes` (a request, then `bytes` back), each after the
// pause a timed restore has before it.
double RawFetchSeconds(size_t bytes, int fetches) {
  RawTcpFetch fetch(bytes);
  return fetch.MedianSeconds(fetches, kIdleBeforeRestore);
}

// The same, each fetch read into shared memory mapped for it: a restore onto another node writes
// into memory its new rank has just handed over, whose first write a host may charge per page.
absl::StatusOr<double> RawFetchIntoNewMemorySeconds(size_t bytes, int fetches) {
  RawTcpFetch fetch(bytes);
  return fetch.MedianSecondsIntoNewMemory(fetches, kIdleBeforeRestore);
}

// The seconds of `restores` restores of `bytes` each into new ranks' memory in huge pages
// (`restore(i)` makes the i-th, SharedBuffer::Pages::kHuge), with the pages reserved for them as
// root (their daemon keeps each new rank's memory a while after, for the rank's next process).
// None, and a note saying why, when the pages cannot be had; an error when a restore fails.
absl::StatusOr<std::vector<double>> RestoresIntoHugePages(
    Report& report, size_t bytes, int restores,
    const std::function<absl::StatusOr<double>(int)>& restore) {
  const uint64_t page = testing::HugePageReservation::PageBytes();
  absl::StatusOr<std::unique_ptr<testing::HugePageReservation>> reserved =
      page == 0 ? absl::FailedPreconditionError("this kernel has no huge pages")
                : testing::HugePageReservation::Reserve((bytes + page - 1) / page * restores);
  std::vector<double> seconds;
  absl::Status missing = reserved.status();
  for (int i = 0; missing.ok() && i < restores; ++i) {
    absl::StatusOr<double> restored = restore(i);
    if (absl::IsResourceExhausted(restored.status())) {
      missing = restored.status();  // a restore's memory got no huge pages
    } else if (!restored.ok()) {
      return restored.status();
    } else {
      seconds.push_back(*restored);
    }
  }
  if (!missing.ok()) {
    report.AddNote("cluster", absl::StrCat("Restores into huge pages (", bytes >> 20,
                                           " MiB) not measured: ", missing.message()));
    seconds.clear();
  }
  return seconds;
}

// The faster of two measurements of a limit, taken before and after the figures it bounds: a
// limit measured in a slow minute alone would flatter them.
absl::StatusOr<double> Faster(const absl::StatusOr<double>& before,
                              const absl::StatusOr<double>& after) {
  if (!before.ok()) return before;
  if (!after.ok()) return after;
  return std::min(*before, *after);
}

// The machine can do at least what it did once: loopback TCP on a shared machine reads 1.7 to 7
// GB/s from one minute to the next, and a limit measured in a slow minute would flatter every
// figure after it.
Limits Best(const Limits& a, const Limits& b) {
  return {std::max(a.memcpy_gbps, b.memcpy_gbps), std::max(a.tcp_gbps, b.tcp_gbps)};
}

}  // namespace

absl::Status RunClusterSuite(Report& report) {
  SetLogLevel(LogLevel::kWarning);  // the daemons' per-step lines would bury the table
  // Measured before each shape and once after the last; every figure stands beside the best
  // measured in the whole run, so a slow minute at the start flatters no shape.
  Limits limits = MeasureLimits();
  double slowest_tcp_gbps = limits.tcp_gbps;
  int limit_measurements = 1;
  // One etcd for every shape, writing to disk as a production one does.
  absl::StatusOr<std::unique_ptr<testing::EtcdCluster>> etcd =
      testing::EtcdCluster::Start({.members = 1, .fsync = true});
  if (!etcd.ok()) return etcd.status();
  struct Shape {
    int nodes, k, m;
    Sizes sizes;
    int dense_steps = kStepsOfEachKind;
    int expert_restores = 0;  // of an expert from its live holder onto another node
  };
  // The last shape holds 512 MiB per node (experts of 64 MiB), for the fixed costs of a step and
  // of an expert's restore measured against more bytes; its dense steps take a second each, so
  // fewer of them count.
  const Sizes large{.region_bytes = 64 << 20,
                    .regions = kRegionsPerNode,
                    .stripe_unit_bytes = 4 << 20,
                    .pool_bytes = 4 * (uint64_t{512} << 20) + (16 << 20),
                    .capture_threads = 2};
  // The figures whose limits are the machine's memcpy and raw TCP rates, added to the report in
  // order once the run has measured its best rates.
  std::vector<std::function<void(const Limits&)>> figures;
  for (const Shape& shape : {Shape{3, 2, 1, {}}, Shape{6, 4, 2, {}}, Shape{12, 4, 2, {}},
                             Shape{3, 2, 1, large, 5, 8}}) {
    const Limits now = MeasureLimits();
    slowest_tcp_gbps = std::min(slowest_tcp_gbps, now.tcp_gbps);
    ++limit_measurements;
    limits = Best(limits, now);
    absl::StatusOr<std::unique_ptr<LoopbackCluster>> cluster =
        LoopbackCluster::Start(**etcd, shape.nodes, shape.k, shape.m, shape.sizes);
    if (!cluster.ok()) return cluster.status();
    absl::StatusOr<double> first = (*cluster)->CommitStep(1, {});
    if (!first.ok()) return first.status();
    std::vector<double> dense, sparse;
    int step = 2;
    for (int i = 0; i < shape.dense_steps; ++i, ++step) {
      absl::StatusOr<double> seconds = (*cluster)->CommitStep(step, {});
      if (!seconds.ok()) return seconds.status();
      dense.push_back(*seconds);
    }
    for (int i = 0; i < kStepsOfEachKind; ++i, ++step) {
      absl::StatusOr<double> seconds = (*cluster)->CommitStep(step, {step % shape.sizes.regions});
      if (!seconds.ok()) return seconds.status();
      sparse.push_back(*seconds);
    }
    // The limit for a step moving `bytes` per node: each node copies them once and sends m copies;
    // all nodes share this machine's cores and its loopback, so the nodes' work adds up.
    const double total = static_cast<double>(shape.sizes.node_bytes()) * shape.nodes;
    auto limit_seconds = [total, m = shape.m](const Limits& best, double changed_fraction) {
      const double bytes = total * changed_fraction;
      return bytes / (best.memcpy_gbps * 1e9) + m * bytes / (best.tcp_gbps * 1e9);
    };
    const std::string label = absl::StrCat(shape.nodes, " nodes (", shape.k, ",", shape.m, "), ",
                                           shape.sizes.node_bytes() >> 20, " MiB/node");
    const double dense_seconds = Median(dense);
    const double first_seconds = *first;
    const double sparse_fraction = 1.0 / shape.sizes.regions;
    const double sparse_seconds = Median(sparse);
    const int regions = shape.sizes.regions;
    figures.push_back([=, &report](const Limits& best) {
      const double dense_limit = limit_seconds(best, 1);
      const double sparse_limit = limit_seconds(best, sparse_fraction);
      report.Add({"cluster", absl::StrCat("dense step committed, ", label),
                  total / dense_seconds / 1e9, "GB/s", "memcpy + m x raw TCP of the same bytes",
                  total / dense_limit / 1e9, dense_limit / dense_seconds});
      report.Add({"cluster", absl::StrCat("first step (whole encode), ", label),
                  first_seconds * 1e3, "ms", "a later dense step (every stripe afresh)",
                  dense_seconds * 1e3, first_seconds / dense_seconds});
      report.Add({"cluster",
                  absl::StrCat("sparse step (1 of ", regions, " experts) committed, ", label),
                  sparse_seconds * 1e3, "ms", "memcpy + m x raw TCP of the changed bytes",
                  sparse_limit * 1e3, sparse_limit / sparse_seconds});
    });
    if (shape.expert_restores > 0) {
      // Experts of ranks 1 and 2 in turn, each into a new rank on node 0: the group's record on
      // node 0 names the holder, so no restore asks where the rank is.
      const absl::StatusOr<double> new_memory_before =
          RawFetchIntoNewMemorySeconds(shape.sizes.region_bytes, shape.expert_restores);
      std::vector<double> restores;
      for (int i = 0; i < shape.expert_restores; ++i) {
        absl::StatusOr<double> seconds = (*cluster)->RestoreElsewhere(
            0, 1 + i % 2, i / 2 % shape.sizes.regions, 2000 + static_cast<uint32_t>(i));
        if (!seconds.ok()) return seconds.status();
        restores.push_back(*seconds);
      }
      const double expert = static_cast<double>(shape.sizes.region_bytes);
      const double limit = RawFetchSeconds(shape.sizes.region_bytes, shape.expert_restores);
      const absl::StatusOr<double> new_memory_limit = Faster(
          new_memory_before,
          RawFetchIntoNewMemorySeconds(shape.sizes.region_bytes, shape.expert_restores));
      if (!new_memory_limit.ok()) return new_memory_limit.status();
      const std::string name =
          absl::StrCat("expert restored onto another node, from its holder (",
                       shape.sizes.region_bytes >> 20, " MiB), median of ", shape.expert_restores);
      const double seconds = Median(restores);
      // The same restores into huge pages, where the host charges the first access per page.
      const absl::StatusOr<std::vector<double>> into_huge_pages = RestoresIntoHugePages(
          report, shape.sizes.region_bytes, shape.expert_restores, [&](int i) {
            return (*cluster)->RestoreElsewhere(0, 1 + i % 2, i / 2 % shape.sizes.regions,
                                                2500 + static_cast<uint32_t>(i),
                                                SharedBuffer::Pages::kHuge);
          });
      if (!into_huge_pages.ok()) return into_huge_pages.status();
      const std::string huge_name = absl::StrCat(
          "expert restored onto another node, from its holder, into huge pages (",
          shape.sizes.region_bytes >> 20, " MiB), median of ", shape.expert_restores);
      figures.push_back([=, &report](const Limits&) {
        report.Add({"cluster", name, expert / seconds / 1e9, "GB/s", "raw TCP fetch of the bytes",
                    expert / limit / 1e9, limit / seconds});
        report.Add({"cluster", name, expert / seconds / 1e9, "GB/s",
                    "raw TCP fetch of the bytes into newly mapped shared memory",
                    expert / *new_memory_limit / 1e9, *new_memory_limit / seconds});
        if (!into_huge_pages->empty()) {
          const double huge_seconds = Median(*into_huge_pages);
          report.Add({"cluster", huge_name, expert / huge_seconds / 1e9, "GB/s",
                      "raw TCP fetch of the bytes", expert / limit / 1e9, limit / huge_seconds});
        }
      });
    }

    if (shape.nodes == 6) {
      absl::StatusOr<v1::ClusterStatusResponse> status = (*cluster)->Status(1);
      if (!status.ok()) return status.status();
      const v1::NodeMemory& memory = status->nodes(1).memory();
      const double per_data_byte =
          static_cast<double>(memory.data_bytes() + memory.parity_bytes()) / memory.data_bytes();
      figures.push_back([=, &report](const Limits&) {
        report.Add({"cluster", "memory per node for 2 lost nodes, (4,2) data + parity",
                    per_data_byte, "x data", "replication x3 (also survives 2 lost)", 3.0,
                    per_data_byte / 3.0});
        report.Add({"cluster", "memory per node for 2 lost nodes, (4,2) data + parity",
                    per_data_byte, "x data", "replication x2 (survives 1 lost)", 2.0,
                    per_data_byte / 2.0});
      });

      // Node 1 rebuilt whole three times (a node asked to rebuild does so holding its step); the
      // median rebuild counts.
      std::vector<v1::RebuildResponse> rebuilds;
      for (int attempt = 0; attempt < 3; ++attempt) {
        absl::StatusOr<v1::RebuildResponse> rebuilt = (*cluster)->Rebuild(1);
        if (!rebuilt.ok()) return rebuilt.status();
        rebuilds.push_back(*std::move(rebuilt));
      }
      std::sort(rebuilds.begin(), rebuilds.end(), [](const auto& a, const auto& b) {
        return a.seconds() < b.seconds();
      });
      const v1::RebuildResponse* rebuilt = &rebuilds[1];
      // The limit: the fetched bytes over raw TCP, and a raw decode reading them.
      absl::StatusOr<std::unique_ptr<erasure::ReedSolomon>> codec =
          erasure::ReedSolomon::Create(4, 2);
      if (!codec.ok()) return codec.status();
      std::vector<AlignedBuffer> units;
      for (int i = 0; i < 6; ++i) units.emplace_back(kChunkBytes, static_cast<uint8_t>(i));
      std::vector<uint8_t*> pointers;
      for (AlignedBuffer& unit : units) pointers.push_back(unit.data());
      // A decode of one unit from k, as a repair needs (a helper decodes the unit it sends alone).
      const std::vector<int> sources = {2, 3, 4, 5};
      const std::vector<int> wanted = {0};
      const Comparison decode = CompareGigabytesPerSecond(
          [&] { (void)(*codec)->DecodeFrom(pointers, sources, wanted, kChunkBytes); },
          [&] { (void)(*codec)->DecodeFrom(pointers, sources, wanted, kChunkBytes); },
          4 * kChunkBytes, {.min_seconds_per_repetition = 0.1, .repetitions = 2});
      // Helpers decode each stripe's unit and send it on: the rebuilding node receives one unit
      // per unit it rebuilds, the helpers the other k - 1 sources. On loopback every byte moved
      // crosses the one machine, so the limit counts them all, and a decode of k units for each
      // unit rebuilt.
      const double received = static_cast<double>(rebuilt->fetched_bytes());
      const double moved = received + static_cast<double>(rebuilt->helper_fetched_bytes());
      const double rebuilt_bytes =
          static_cast<double>(rebuilt->data_bytes() + rebuilt->parity_bytes());
      const double rebuild_seconds = rebuilt->seconds();
      const double decode_gbps = decode.value;
      figures.push_back([=, &report](const Limits& best) {
        const double limit =
            moved / (best.tcp_gbps * 1e9) + 4 * rebuilt_bytes / (decode_gbps * 1e9);
        report.Add({"cluster", "rebuild of a node, (4,2), 32 MiB data, median of 3",
                    rebuilt_bytes / rebuild_seconds / 1e9, "GB/s",
                    "raw TCP of the bytes moved + raw decode", rebuilt_bytes / limit / 1e9,
                    limit / rebuild_seconds});
        report.Add({"cluster", "rebuild: bytes the rebuilding node receives per byte it rebuilds",
                    received / rebuilt_bytes, "x", "one copy of what it rebuilds", 1.0,
                    rebuilt_bytes / received});
        report.Add({"cluster", "rebuild: bytes moved in all per byte rebuilt",
                    moved / rebuilt_bytes, "x", "k = 4 units fetched per unit (conventional repair)",
                    4.0, 4.0 * rebuilt_bytes / moved});
      });

      // Elastic restore of one 4 MiB expert onto another node: from its live holder, then decoded
      // from the group after the holder is lost (k units of each stripe it spans are fetched).
      // The first restore of a rank asks every node where the rank is; later ones of the same
      // rank go to the holder at once, while the committed step stays the same. Each restore is a
      // new rank's (a fresh client); the medians are of 4, 16 and 8 restores.
      const absl::StatusOr<double> held_new_memory_before =
          RawFetchIntoNewMemorySeconds(kRegionBytes, 16);
      std::vector<double> first_of_rank, held, decoded;
      for (uint32_t source_rank : {1, 2, 4, 5}) {
        absl::StatusOr<double> seconds =
            (*cluster)->RestoreElsewhere(0, source_rank, 0, 200 + source_rank);
        if (!seconds.ok()) return seconds.status();
        first_of_rank.push_back(*seconds);
      }
      // Regions [from, from + 4) of rank 3, `rounds` times over, each into a new rank.
      auto restore_rank3 = [&](int rounds, int from, std::vector<double>& times) -> absl::Status {
        for (int round = 0; round < rounds; ++round) {
          for (int region = from; region < from + 4; ++region) {
            absl::StatusOr<double> seconds =
                (*cluster)->RestoreElsewhere(0, 3, region, 1000 + 8 * round + region);
            if (!seconds.ok()) return seconds.status();
            times.push_back(*seconds);
          }
        }
        return absl::OkStatus();
      };
      if (absl::Status restored = restore_rank3(4, 0, held); !restored.ok()) return restored;
      // The same 16 restores into huge pages.
      const absl::StatusOr<std::vector<double>> held_huge =
          RestoresIntoHugePages(report, kRegionBytes, 16, [&](int i) {
            return (*cluster)->RestoreElsewhere(0, 3, i % 4, 1500 + 8 * (i / 4) + i % 4,
                                                SharedBuffer::Pages::kHuge);
          });
      if (!held_huge.ok()) return held_huge.status();
      (*cluster)->Lose(3);
      if (absl::Status restored = restore_rank3(2, 4, decoded); !restored.ok()) return restored;
      const double expert = static_cast<double>(kRegionBytes);
      const double held_limit = RawFetchSeconds(kRegionBytes, 16);
      const absl::StatusOr<double> held_new_memory_limit =
          Faster(held_new_memory_before, RawFetchIntoNewMemorySeconds(kRegionBytes, 16));
      if (!held_new_memory_limit.ok()) return held_new_memory_limit.status();
      const double held_seconds = Median(held);
      const double first_of_rank_seconds = Median(first_of_rank);
      const double decoded_seconds = Median(decoded);
      figures.push_back([=, &report](const Limits& best) {
        report.Add({"cluster", "expert restored onto another node, from its holder (4 MiB)",
                    expert / held_seconds / 1e9, "GB/s", "raw TCP fetch of the bytes",
                    expert / held_limit / 1e9, held_limit / held_seconds});
        report.Add({"cluster", "expert restored onto another node, from its holder (4 MiB)",
                    expert / held_seconds / 1e9, "GB/s",
                    "raw TCP fetch of the bytes into newly mapped shared memory",
                    expert / *held_new_memory_limit / 1e9, *held_new_memory_limit / held_seconds});
        if (!held_huge->empty()) {
          const double huge_seconds = Median(*held_huge);
          report.Add({"cluster",
                      "expert restored onto another node, from its holder, into huge pages (4 MiB)",
                      expert / huge_seconds / 1e9, "GB/s", "raw TCP fetch of the bytes",
                      expert / held_limit / 1e9, held_limit / huge_seconds});
        }
        report.Add(
            {"cluster",
             "expert restored onto another node, from its holder, first of its rank (4 MiB)",
             expert / first_of_rank_seconds / 1e9, "GB/s", "raw TCP fetch of the bytes",
             expert / held_limit / 1e9, held_limit / first_of_rank_seconds});
        // What the raw fetch itself reaches of the stream's throughput: how much of a restore's
        // distance from the stream is the fetch's, not the daemons'.
        report.Add({"cluster", "raw TCP fetch of 4 MiB after 5 ms idle", expert / held_limit / 1e9,
                    "GB/s", "raw TCP stream", best.tcp_gbps,
                    expert / held_limit / 1e9 / best.tcp_gbps});
        const double decode_limit =
            4 * expert / (best.tcp_gbps * 1e9) + 4 * expert / (decode_gbps * 1e9);
        report.Add({"cluster", "expert restored onto another node, holder lost: decoded (4 MiB)",
                    expert / decoded_seconds / 1e9, "GB/s", "raw TCP of k units + raw decode",
                    expert / decode_limit / 1e9, decode_limit / decoded_seconds});
      });
    }
  }
  {
    // A rank of 2,048 tensors restored onto another node from its live holder, all in one call:
    // whatever the holder does per region counts 2,048 times (its regions come a call each).
    const Sizes many{.region_bytes = 32 << 10,
                     .regions = 2048,
                     .stripe_unit_bytes = 4 << 20,
                     .pool_bytes = 4 * (uint64_t{64} << 20) + (16 << 20)};
    absl::StatusOr<std::unique_ptr<LoopbackCluster>> cluster =
        LoopbackCluster::Start(**etcd, 3, 2, 1, many);
    if (!cluster.ok()) return cluster.status();
    if (absl::StatusOr<double> first = (*cluster)->CommitStep(1, {}); !first.ok()) {
      return first.status();
    }
    // Nine restores: the median of three moved by a fifth between runs of one build.
    const absl::StatusOr<double> new_memory_before =
        RawFetchIntoNewMemorySeconds(many.node_bytes(), 9);
    std::vector<double> restores;
    for (uint32_t attempt = 0; attempt < 9; ++attempt) {
      absl::StatusOr<double> seconds = (*cluster)->RestoreRankElsewhere(0, 1, 300 + attempt);
      if (!seconds.ok()) return seconds.status();
      restores.push_back(*seconds);
    }
    const absl::StatusOr<std::vector<double>> into_huge_pages =
        RestoresIntoHugePages(report, many.node_bytes(), 9, [&](int i) {
          return (*cluster)->RestoreRankElsewhere(0, 1, 400 + static_cast<uint32_t>(i),
                                                  SharedBuffer::Pages::kHuge);
        });
    if (!into_huge_pages.ok()) return into_huge_pages.status();
    const double bytes = static_cast<double>(many.node_bytes());
    const double seconds = Median(restores);
    const absl::StatusOr<double> new_memory_limit =
        Faster(new_memory_before, RawFetchIntoNewMemorySeconds(many.node_bytes(), 9));
    if (!new_memory_limit.ok()) return new_memory_limit.status();
    figures.push_back([=, &report](const Limits& best) {
      const double limit = bytes / (best.tcp_gbps * 1e9);
      const std::string name =
          "a rank of 2,048 tensors (64 MiB) restored onto another node, from its holder, median of 9";
      report.Add({"cluster", name, bytes / seconds / 1e9, "GB/s", "raw TCP of the bytes",
                  bytes / limit / 1e9, limit / seconds});
      report.Add({"cluster", name, bytes / seconds / 1e9, "GB/s",
                  "raw TCP fetch of the bytes into newly mapped shared memory",
                  bytes / *new_memory_limit / 1e9, *new_memory_limit / seconds});
      if (!into_huge_pages->empty()) {
        const double huge_seconds = Median(*into_huge_pages);
        report.Add({"cluster",
                    "a rank of 2,048 tensors (64 MiB) restored onto another node, from its holder, "
                    "into huge pages, median of 9",
                    bytes / huge_seconds / 1e9, "GB/s", "raw TCP of the bytes", bytes / limit / 1e9,
                    limit / huge_seconds});
      }
    });
  }
  {
    // A step of 64 MiB per node held as 16,384 tensors of 4 KiB (the Adam state of 4,096 small
    // layers), beside the same bytes as 16 tensors of 4 MiB on a cluster of the same shape: the
    // stripes, units and bytes moved are the same, so what the first costs more is what the
    // daemons do per region in a step. The sparse step changes one tensor: one data unit either
    // way.
    struct Steps {
      double dense = 0, sparse = 0;
    };
    auto measure = [&](const Sizes& sizes) -> absl::StatusOr<Steps> {
      absl::StatusOr<std::unique_ptr<LoopbackCluster>> cluster =
          LoopbackCluster::Start(**etcd, 3, 2, 1, sizes);
      if (!cluster.ok()) return cluster.status();
      std::vector<double> dense, sparse;
      for (int step = 1; step <= 1 + 2 * kStepsOfEachKind; ++step) {
        const bool is_sparse = step > 1 + kStepsOfEachKind;
        absl::StatusOr<double> seconds =
            (*cluster)->CommitStep(step, is_sparse ? std::vector<int>{step % sizes.regions}
                                                   : std::vector<int>{});
        if (!seconds.ok()) return seconds.status();
        if (step > 1) (is_sparse ? sparse : dense).push_back(*seconds);
      }
      return Steps{Median(dense), Median(sparse)};
    };
    constexpr uint64_t kNode = uint64_t{64} << 20;
    const Sizes pool{.region_bytes = 4 << 20, .regions = 16, .pool_bytes = 4 * kNode + (16 << 20)};
    Sizes tensors = pool;
    tensors.region_bytes = 4 << 10;
    tensors.regions = 16384;
    tensors.journal_bytes = 16 << 20;  // the daemon's default: three images of 16,384 regions
    absl::StatusOr<Steps> few = measure(pool);
    if (!few.ok()) return few.status();
    absl::StatusOr<Steps> many = measure(tensors);
    if (!many.ok()) return many.status();
    const double total = 3.0 * kNode;
    figures.push_back([=, &report](const Limits& best) {
      const double dense_limit = total / (best.memcpy_gbps * 1e9) + total / (best.tcp_gbps * 1e9);
      report.Add({"cluster", "dense step committed, 3 nodes (2,1), 16,384 tensors of 4 KiB/node",
                  total / many->dense / 1e9, "GB/s", "memcpy + m x raw TCP of the same bytes",
                  total / dense_limit / 1e9, dense_limit / many->dense});
      report.Add({"cluster", "dense step committed, 3 nodes (2,1), 16,384 tensors of 4 KiB/node",
                  many->dense * 1e3, "ms", "the same 64 MiB/node as 16 tensors of 4 MiB",
                  few->dense * 1e3, few->dense / many->dense});
      report.Add({"cluster", "sparse step (1 of 16,384 tensors) committed, 3 nodes (2,1)",
                  many->sparse * 1e3, "ms", "1 of 16 tensors of 4 MiB (one data unit either way)",
                  few->sparse * 1e3, few->sparse / many->sparse});
    });
  }
  {
    const Limits now = MeasureLimits();
    slowest_tcp_gbps = std::min(slowest_tcp_gbps, now.tcp_gbps);
    ++limit_measurements;
    limits = Best(limits, now);
  }
  for (const std::function<void(const Limits&)>& figure : figures) figure(limits);
  absl::StatusOr<double> put_ms = EtcdPutMilliseconds(**etcd);
  if (!put_ms.ok()) return put_ms.status();
  for (int nodes : {3, 6, 12, 24}) {
    absl::StatusOr<ControlCost> cost = MeasureControl(**etcd, nodes);
    if (!cost.ok()) return cost.status();
    const std::string label = absl::StrCat(nodes, " nodes");
    report.Add({"cluster",
                absl::StrCat("etcd writes per step (etcd's mvcc puts + deletes), ", label),
                cost->kv_writes, "writes", "one decision per step", 1.0, cost->kv_writes});
    report.Add({"cluster", absl::StrCat("etcd raft entries per step (etcd's proposals), ", label),
                cost->proposals, "entries", "one decision per step", 1.0, cost->proposals});
    report.Add({"cluster", absl::StrCat("etcd writes per step (daemons' own count), ", label),
                cost->client_writes, "writes", "etcd's mvcc puts + deletes", cost->kv_writes,
                cost->kv_writes > 0 ? cost->client_writes / cost->kv_writes : 0});
    report.Add({"cluster", absl::StrCat("control messages (Peer calls) per step per node, ", label),
                cost->peer_calls, "calls", "a proposal + an encode per node", 2.0,
                cost->peer_calls / 2.0});
    report.Add({"cluster",
                absl::StrCat("lease keep-alives per node per TTL (etcd's count), ", label),
                cost->renewals, "renewals", "one per third of a TTL", 3.0, cost->renewals / 3.0});
    report.Add({"cluster", absl::StrCat("commit latency, 64 KiB/node, ", label), cost->commit_ms,
                "ms", "one etcd put (fsync) round trip", *put_ms, *put_ms / cost->commit_ms});
  }
  report.AddNote(
      "cluster",
      absl::StrCat(
          "Real daemons in one process on 127.0.0.1, a trainer rank per node with 8 regions of "
          "4 MiB (64 MiB in the 512 MiB/node shape; 4 MiB stripe units). A step's time runs "
          "from the ranks' Snapshot calls (each rank on its own thread, as a job's trainer "
          "processes call) to the last rank's WaitCommitted: capture, data units (or deltas) to "
          "the parity holders, the two-phase commit. Medians of ", kStepsOfEachKind,
          " steps of each kind (5 dense steps at 512 MiB/node); the 16,384-tensor shape and its "
          "16-tensor twin hold 64 MiB/node with a 16 MiB journal. Limits measured in this run: "
          "memcpy ", absl::StrFormat("%.1f", limits.memcpy_gbps), " GB/s, raw TCP ",
          absl::StrFormat("%.1f", limits.tcp_gbps), " GB/s, the best of ", limit_measurements,
          " measurements, before each shape and once after the last (raw TCP's lowest ",
          absl::StrFormat("%.1f", slowest_tcp_gbps),
          " GB/s), every figure beside that best; every node shares the same cores, so "
          "limits add the nodes' work. Memory: parity rounds up to whole stripes, so small nodes "
          "pay more than (k+m)/k. Control cost: the same daemons with one 64 KiB region per node "
          "and 4 MiB pools, (2,1) at 3 nodes and (4,2) groups above, ", kControlSteps,
          " dense steps after the first; etcd's counters are read from its /metrics before and "
          "after them, the daemons' from ClusterStatus (peer_calls, etcd_writes), keep-alives "
          "over one TTL after them; lease TTL ", kControlLeaseMs, " ms; etcd with fsync. etcd's "
          "raft entries count every write RPC, Txns whose compare failed too. A restore onto "
          "another node writes into memory its new rank has just handed over: it stands beside a "
          "raw fetch into memory read before, and beside one into shared memory mapped for each "
          "fetch (the faster of a measurement before and after the restores), since a host may "
          "charge the first access to each page of a new mapping."));
  return absl::OkStatus();
}

}  // namespace moesnap::bench
