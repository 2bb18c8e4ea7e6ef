// The cluster suite: real moesnapd daemons (in this process, each with its own pool, sockets, Peer
// service and data plane on loopback) and a trainer rank per node.
//   - A committed step on 3, 6 and 12 nodes, dense and sparse: from the trainers' Snapshot calls to
//     every node's WaitCommitted. Its limit: copying the node's bytes once (memcpy) plus sending m
//     copies of them over a raw TCP stream, both measured in this run.
//   - Rebuild of a node of a (4, 2) group from the survivors, against raw TCP for the bytes fetched
//     plus a raw Reed-Solomon decode of them.
//   - Memory per node for two-loss protection: data + parity against replication x3.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
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
#include "proto/moesnap.grpc.pb.h"
#include "tests/testing/etcd_process.h"

namespace moesnap::bench {
namespace {

constexpr size_t kRegionBytes = 4 << 20;
constexpr int kRegionsPerNode = 8;  // 32 MiB of trainer state per node
constexpr size_t kNodeBytes = kRegionBytes * kRegionsPerNode;
constexpr int kDenseSteps = 5;
constexpr size_t kChunkBytes = 4 << 20;

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration duration) { return std::chrono::duration<double>(duration).count(); }

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// N daemons of one cluster (a job of their own on `etcd`) and a trainer rank on each, all in this
// process.
class LoopbackCluster {
 public:
  static absl::StatusOr<std::unique_ptr<LoopbackCluster>> Start(const testing::EtcdCluster& etcd,
                                                                int nodes, int k, int m) {
    auto cluster = std::unique_ptr<LoopbackCluster>(new LoopbackCluster());
    cluster->directory_ = absl::StrCat("/tmp/moesnap-bench-cluster-", getpid());
    std::filesystem::create_directories(cluster->directory_);
    daemon::ClusterOptions shape;
    static int jobs = 0;
    shape.job = absl::StrCat("bench-", getpid(), "-", jobs++);
    shape.node_count = nodes;
    shape.data_units = k;
    shape.parity_units = m;
    shape.stripe_unit_bytes = 4 << 20;
    shape.lease_ttl_ms = 5000;
    shape.commit_timeout_ms = 60000;
    shape.etcd_endpoints = etcd.endpoints();
    shape.advertise_host = "127.0.0.1";
    shape.control_port = 0;
    shape.data_port = 0;
    for (int id = 0; id < nodes; ++id) {
      daemon::DaemonOptions options;
      options.node_id = id;
      options.agent_socket = absl::StrCat(cluster->directory_, "/agent", id, ".sock");
      options.admin_socket = absl::StrCat(cluster->directory_, "/admin", id, ".sock");
      options.http.address = "";  // six daemons in one process: none serves metrics
      options.pool.name = absl::StrCat("moesnap-bench-cluster-", getpid(), "-", id);
      // Committed + captured + parity (m/k of the data, rounded up per stripe) + a rebuild's copy.
      options.pool.bytes = 4 * kNodeBytes + (16 << 20);
      options.pool.journal_bytes = 1 << 20;
      options.pool.lock = daemon::PoolLockMode::kOff;
      options.capture.threads = 2;
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
      absl::StatusOr<std::shared_ptr<SharedBuffer>> state = (*client)->AllocateHost(kNodeBytes);
      if (!state.ok()) return state.status();
      std::memset((*state)->data(), id + 1, kNodeBytes);
      for (int region = 0; region < kRegionsPerNode; ++region) {
        if (absl::Status status = (*client)->RegisterHostRegion(
                {absl::StrCat("expert", region), "float32", {}}, *state, region * kRegionBytes,
                kRegionBytes);
            !status.ok()) {
          return status;
        }
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
      for (const char* suffix : {".data", ".journal"}) std::filesystem::remove("/dev/shm/" + pool + suffix);
    }
    std::filesystem::remove_all(directory_);
  }

  // Changes `regions` of every node (all when empty), snapshots them as `step` everywhere and waits
  // until every node committed it; returns the seconds that took.
  absl::StatusOr<double> CommitStep(int64_t step, const std::vector<int>& regions) {
    std::vector<std::string> names;
    for (int region : regions) names.push_back(absl::StrCat("expert", region));
    for (size_t node = 0; node < clients_.size(); ++node) {
      for (int region = 0; region < kRegionsPerNode; ++region) {
        if (regions.empty() || std::find(regions.begin(), regions.end(), region) != regions.end()) {
          states_[node]->data()[region * kRegionBytes + step % 4096] ^= 0xff;
        }
      }
    }
    const Clock::time_point start = Clock::now();
    for (auto& client : clients_) {
      if (absl::StatusOr<uint64_t> bytes = client->Snapshot(step, names); !bytes.ok()) {
        return bytes.status();
      }
    }
    for (auto& client : clients_) {
      if (absl::Status status = client->WaitCommitted(step); !status.ok()) return status;
    }
    return Seconds(Clock::now() - start);
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

  // Restores region `expert<region>` of `source_rank` into a new rank on `node`; returns seconds.
  absl::StatusOr<double> RestoreElsewhere(int node, uint32_t source_rank, int region, uint32_t new_rank) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(
        {.socket_path = absl::StrCat(directory_, "/agent", node, ".sock"), .rank = new_rank});
    if (!client.ok()) return client.status();
    absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = (*client)->AllocateHost(kRegionBytes);
    if (!buffer.ok()) return buffer.status();
    const std::string name = absl::StrCat("expert", region);
    if (absl::Status status = (*client)->RegisterHostRegion({name, "float32", {}}, *buffer, 0,
                                                            kRegionBytes);
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

  std::string directory_;
  std::vector<std::string> pools_;
  std::vector<std::unique_ptr<daemon::Daemon>> daemons_;
  std::vector<std::unique_ptr<v1::Admin::Stub>> admins_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::shared_ptr<SharedBuffer>> states_;
};

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

}  // namespace

absl::Status RunClusterSuite(Report& report) {
  SetLogLevel(LogLevel::kWarning);  // the daemons' per-step lines would bury the table
  const Limits limits = MeasureLimits();
  // One etcd for every shape, writing to disk as a production one does.
  absl::StatusOr<std::unique_ptr<testing::EtcdCluster>> etcd =
      testing::EtcdCluster::Start({.members = 1, .fsync = true});
  if (!etcd.ok()) return etcd.status();
  struct Shape {
    int nodes, k, m;
  };
  for (Shape shape : {Shape{3, 2, 1}, Shape{6, 4, 2}, Shape{12, 4, 2}}) {
    absl::StatusOr<std::unique_ptr<LoopbackCluster>> cluster =
        LoopbackCluster::Start(**etcd, shape.nodes, shape.k, shape.m);
    if (!cluster.ok()) return cluster.status();
    absl::StatusOr<double> first = (*cluster)->CommitStep(1, {});
    if (!first.ok()) return first.status();
    std::vector<double> dense, sparse;
    for (int step = 2; step < 2 + kDenseSteps; ++step) {
      absl::StatusOr<double> seconds = (*cluster)->CommitStep(step, {});
      if (!seconds.ok()) return seconds.status();
      dense.push_back(*seconds);
    }
    for (int step = 2 + kDenseSteps; step < 2 + 2 * kDenseSteps; ++step) {
      absl::StatusOr<double> seconds = (*cluster)->CommitStep(step, {step % kRegionsPerNode});
      if (!seconds.ok()) return seconds.status();
      sparse.push_back(*seconds);
    }
    // The limit for a step moving `bytes` per node: each node copies them once and sends m copies;
    // all nodes share this machine's cores and its loopback, so the nodes' work adds up.
    const double total = static_cast<double>(kNodeBytes) * shape.nodes;
    auto limit_seconds = [&](double changed_fraction) {
      const double bytes = total * changed_fraction;
      return bytes / (limits.memcpy_gbps * 1e9) + shape.m * bytes / (limits.tcp_gbps * 1e9);
    };
    const std::string label = absl::StrCat(shape.nodes, " nodes (", shape.k, ",", shape.m, ")");
    const double dense_seconds = Median(dense);
    report.Add({"cluster", absl::StrCat("dense step committed, ", label, ", 32 MiB/node"),
                total / dense_seconds / 1e9, "GB/s", "memcpy + m x raw TCP of the same bytes",
                total / limit_seconds(1) / 1e9, limit_seconds(1) / dense_seconds});
    report.Add({"cluster", absl::StrCat("first step (whole encode), ", label), *first * 1e3, "ms",
                "dense step as deltas", dense_seconds * 1e3, *first / dense_seconds});
    const double sparse_fraction = 1.0 / kRegionsPerNode;
    const double sparse_seconds = Median(sparse);
    report.Add({"cluster", absl::StrCat("sparse step (1 of 8 experts) committed, ", label),
                sparse_seconds * 1e3, "ms", "memcpy + m x raw TCP of the changed bytes",
                limit_seconds(sparse_fraction) * 1e3, limit_seconds(sparse_fraction) / sparse_seconds});

    if (shape.nodes == 6) {
      absl::StatusOr<v1::ClusterStatusResponse> status = (*cluster)->Status(1);
      if (!status.ok()) return status.status();
      const v1::NodeMemory& memory = status->nodes(1).memory();
      const double per_data_byte =
          static_cast<double>(memory.data_bytes() + memory.parity_bytes()) / memory.data_bytes();
      report.Add({"cluster", "memory per node for 2 lost nodes, (4,2) data + parity", per_data_byte,
                  "x data", "replication x3 (also survives 2 lost)", 3.0, per_data_byte / 3.0});
      report.Add({"cluster", "memory per node for 2 lost nodes, (4,2) data + parity", per_data_byte,
                  "x data", "replication x2 (survives 1 lost)", 2.0, per_data_byte / 2.0});

      absl::StatusOr<v1::RebuildResponse> rebuilt = (*cluster)->Rebuild(1);
      if (!rebuilt.ok()) return rebuilt.status();
      // The limit: the fetched bytes over raw TCP, and a raw decode reading them.
      absl::StatusOr<std::unique_ptr<erasure::ReedSolomon>> codec = erasure::ReedSolomon::Create(4, 2);
      if (!codec.ok()) return codec.status();
      std::vector<AlignedBuffer> units;
      for (int i = 0; i < 6; ++i) units.emplace_back(kChunkBytes, static_cast<uint8_t>(i));
      std::vector<uint8_t*> pointers;
      for (AlignedBuffer& unit : units) pointers.push_back(unit.data());
      const std::vector<int> erased = {0, 1};
      const Comparison decode = CompareGigabytesPerSecond(
          [&] { (void)(*codec)->Decode(pointers, erased, kChunkBytes); },
          [&] { (void)(*codec)->Decode(pointers, erased, kChunkBytes); }, 4 * kChunkBytes,
          {.min_seconds_per_repetition = 0.1, .repetitions = 2});
      const double fetched = static_cast<double>(rebuilt->fetched_bytes());
      const double limit = fetched / (limits.tcp_gbps * 1e9) + fetched / (decode.value * 1e9);
      const double rebuilt_bytes = static_cast<double>(rebuilt->data_bytes() + rebuilt->parity_bytes());
      report.Add({"cluster", "rebuild of a node, (4,2), 32 MiB data", rebuilt_bytes / rebuilt->seconds() / 1e9,
                  "GB/s", "raw TCP of the fetched bytes + raw decode", rebuilt_bytes / limit / 1e9,
                  limit / rebuilt->seconds()});

      // Elastic restore of one 4 MiB expert onto another node: from its live holder, then decoded
      // from the group after the holder is lost (k units of each stripe it spans are fetched).
      std::vector<double> held, decoded;
      for (int region = 0; region < 4; ++region) {
        absl::StatusOr<double> seconds = (*cluster)->RestoreElsewhere(0, 3, region, 100 + region);
        if (!seconds.ok()) return seconds.status();
        held.push_back(*seconds);
      }
      (*cluster)->Lose(3);
      for (int region = 4; region < 8; ++region) {
        absl::StatusOr<double> seconds = (*cluster)->RestoreElsewhere(0, 3, region, 100 + region);
        if (!seconds.ok()) return seconds.status();
        decoded.push_back(*seconds);
      }
      const double expert = static_cast<double>(kRegionBytes);
      const double held_limit = expert / (limits.tcp_gbps * 1e9);
      report.Add({"cluster", "expert restored onto another node, from its holder (4 MiB)",
                  expert / Median(held) / 1e9, "GB/s", "raw TCP of the bytes",
                  expert / held_limit / 1e9, held_limit / Median(held)});
      const double decode_limit = 4 * expert / (limits.tcp_gbps * 1e9) + 4 * expert / (decode.value * 1e9);
      report.Add({"cluster", "expert restored onto another node, holder lost: decoded (4 MiB)",
                  expert / Median(decoded) / 1e9, "GB/s", "raw TCP of k units + raw decode",
                  expert / decode_limit / 1e9, decode_limit / Median(decoded)});
    }
  }
  report.AddNote(
      "cluster",
      absl::StrCat(
          "Real daemons in one process on 127.0.0.1, a trainer rank per node with 8 regions of 4 MiB "
          "(4 MiB stripe units). A step's time runs from the trainers' Snapshot calls to every "
          "node's WaitCommitted: capture, data units (or deltas) to the parity holders, the "
          "two-phase commit. Medians of ", kDenseSteps, " steps. Limits measured in this run: memcpy ",
          absl::StrFormat("%.1f", limits.memcpy_gbps), " GB/s, raw TCP ",
          absl::StrFormat("%.1f", limits.tcp_gbps),
          " GB/s; every node shares the same cores, so limits add the nodes' work. Memory: "
          "parity rounds up to whole stripes, so small nodes pay more than (k+m)/k."));
  return absl::OkStatus();
}

}  // namespace moesnap::bench
