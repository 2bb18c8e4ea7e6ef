// A hostile host on the network against a real cluster (three moesnapd processes, k = 2, m = 1, a
// real etcd): it calls the Peer service and writes frames to the data plane on the daemons' real
// ports. Every hostile request is refused with a message naming what was wrong, no daemon dies,
// and the job's next steps still commit, byte for byte.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/frame.h"
#include "erasure/crc32c.h"
#include "moesnap/client.h"
#include "proto/moesnap.grpc.pb.h"
#include "tests/testing/etcd_process.h"
#include "tests/testing/http_client.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::TestDaemon;
using testing::TestDaemonOptions;
using namespace std::chrono_literals;

constexpr int kNodes = 3;
constexpr size_t kRegionBytes = 300000;
constexpr int64_t kHuge = int64_t{1} << 62;

class HostilePeerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<testing::EtcdCluster>> etcd = testing::EtcdCluster::Start();
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = *std::move(etcd);
    const std::string cluster = absl::StrCat(
        "[cluster]\njob = \"hostile-peer-test\"\nnode_count = ", kNodes,
        "\ndata_units = 2\nparity_units = 1\nstripe_unit_bytes = \"64KiB\"\n"
        "lease_ttl_ms = 2000\ncommit_timeout_ms = 3000\netcd_endpoints = [\"",
        absl::StrJoin(etcd_->endpoints(), "\", \""), "\"]\nadvertise_host = \"127.0.0.1\"\n",
        "control_port = 0\ndata_port = 0\n"
        // Plaintext on loopback: the hostile peer here reaches every port (as any holder of a
        // node's certificate would under mutual TLS, which mtls_test covers); what it sends must
        // still be checked.
        "[tls]\ninsecure = true\n");
    for (int id = 0; id < kNodes; ++id) {
      daemons_.push_back(std::make_unique<TestDaemon>(TestDaemonOptions{
          .pool_bytes = "32MiB", .node_id = static_cast<uint32_t>(id), .extra_config = cluster}));
    }
    ASSERT_TRUE(daemons_[0]->Start());
    ASSERT_NO_FATAL_FAILURE(WaitUntil([&] { return Coordinator() == 0; }, "node 0 coordinates"));
    for (int id = 1; id < kNodes; ++id) ASSERT_TRUE(daemons_[id]->Start());
    ASSERT_NO_FATAL_FAILURE(WaitUntil([&] { return LiveNodes() == kNodes; }, "every node live"));
    for (int id = 0; id < kNodes; ++id) {
      absl::StatusOr<std::unique_ptr<Client>> client =
          Client::Connect({.socket_path = daemons_[id]->agent_socket(),
                           .rank = static_cast<uint32_t>(id)});
      ASSERT_OK(client);
      clients_.push_back(*std::move(client));
      absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = clients_[id]->AllocateHost(kRegionBytes);
      ASSERT_OK(buffer);
      buffers_.push_back(*buffer);
      ASSERT_OK(clients_[id]->RegisterHostRegion(
          {"weights", "uint8", {static_cast<int64_t>(kRegionBytes)}}, buffers_[id], 0,
          kRegionBytes));
    }
    ASSERT_NO_FATAL_FAILURE(CommitEverywhere(1));
    for (int id = 0; id < kNodes; ++id) {
      const v1::ClusterStatusResponse status = Status(id);
      for (const v1::ClusterNodeStatus& node : status.nodes()) {
        if (node.node_id() != static_cast<uint32_t>(id)) continue;
        control_ports_.push_back(node.control_port());
        data_ports_.push_back(static_cast<uint16_t>(node.data_port()));
      }
    }
    ASSERT_EQ(control_ports_.size(), static_cast<size_t>(kNodes));
  }

  v1::ClusterStatusResponse Status(int node) {
    auto stub = v1::Admin::NewStub(grpc::CreateChannel("unix:" + daemons_[node]->admin_socket(),
                                                       grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 5s);
    v1::ClusterStatusResponse response;
    stub->ClusterStatus(&context, {}, &response);
    return response;
  }

  int Coordinator() {
    const v1::ClusterStatusResponse status = Status(0);
    for (const v1::ClusterNodeStatus& node : status.nodes()) {
      if (node.coordinator()) return static_cast<int>(node.node_id());
    }
    return -1;
  }

  // How many nodes every node sees live and answering (a step needs each node to reach the others).
  int LiveNodes() {
    int fewest = kNodes;
    for (int viewer = 0; viewer < kNodes; ++viewer) {
      int live = 0;
      const v1::ClusterStatusResponse status = Status(viewer);
      for (const v1::ClusterNodeStatus& node : status.nodes()) {
        live += node.live() && node.answered() && !node.rebuilding();
      }
      fewest = std::min(fewest, live);
    }
    return fewest;
  }

  template <typename Condition>
  static void WaitUntil(Condition condition, const std::string& what) {
    for (int attempt = 0; attempt < 300; ++attempt) {
      if (condition()) return;
      std::this_thread::sleep_for(100ms);
    }
    FAIL() << "timed out waiting until " << what;
  }

  static uint8_t ByteOf(int node, int64_t step, size_t i) {
    return static_cast<uint8_t>(i * 31 + node * 7 + step * 13);
  }

  // Every node's trainer snapshots `step`; every node commits it. The coordinator's (node 0's)
  // snapshots last: its round begins once its node has the step, when every other node has it
  // too, so no Prepare waits on a trainer still snapshotting (which, on a loaded machine, could
  // take longer than the commit timeout and abort the step).
  void CommitEverywhere(int64_t step) {
    for (int id = kNodes - 1; id >= 0; --id) {
      for (size_t i = 0; i < kRegionBytes; ++i) buffers_[id]->data()[i] = ByteOf(id, step, i);
      ASSERT_OK(clients_[id]->Snapshot(step));
    }
    for (int id = 0; id < kNodes; ++id) {
      const absl::Status committed = clients_[id]->WaitCommitted(step);
      ASSERT_TRUE(committed.ok()) << "node " << id << ", step " << step << ": " << committed;
    }
  }

  // Each node restores `step` into fresh memory, byte for byte.
  void ExpectRestores(int64_t step) {
    for (int id = 0; id < kNodes; ++id) {
      ASSERT_TRUE(daemons_[id]->running()) << "node " << id << "'s daemon died";
      std::memset(buffers_[id]->data(), 0, kRegionBytes);
      absl::StatusOr<RestoreResult> restored = clients_[id]->Restore();
      ASSERT_OK(restored);
      EXPECT_EQ(restored->step, step);
      for (size_t i = 0; i < kRegionBytes; ++i) {
        ASSERT_EQ(buffers_[id]->data()[i], ByteOf(id, step, i)) << "node " << id << " byte " << i;
      }
    }
  }

  std::unique_ptr<v1::Peer::Stub> Peer(int node) {
    return v1::Peer::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", control_ports_[node]),
                                                 grpc::InsecureChannelCredentials()));
  }

  // Calls `method` of node `node`'s Peer service; the status it answers.
  template <typename Request, typename Response>
  grpc::Status Call(int node,
                    grpc::Status (v1::Peer::Stub::*method)(grpc::ClientContext*, const Request&,
                                                           Response*),
                    const Request& request) {
    std::unique_ptr<v1::Peer::Stub> stub = Peer(node);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 20s);
    Response response;
    return ((*stub).*method)(&context, request, &response);
  }

  static void ExpectRefused(const grpc::Status& status, grpc::StatusCode code,
                            const std::string& mentions) {
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), mentions))
        << "'" << status.error_message() << "' does not mention '" << mentions << "'";
  }

  std::unique_ptr<testing::EtcdCluster> etcd_;
  std::vector<std::unique_ptr<TestDaemon>> daemons_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<std::shared_ptr<SharedBuffer>> buffers_;
  std::vector<uint32_t> control_ports_;
  std::vector<uint16_t> data_ports_;
};

// One proposal of a step far ahead of the job once made every later step "passed over" and
// aborted, for good: the abort of the far step was written to etcd.
TEST_F(HostilePeerTest, AProposalFarAheadHoldsNoStepUp) {
  v1::ProposeRequest propose;
  propose.set_from_node(1);
  propose.set_step(kHuge);
  EXPECT_TRUE(Call(0, &v1::Peer::Stub::Propose, propose).ok());
  propose.set_from_node(kNodes);
  ExpectRefused(Call(0, &v1::Peer::Stub::Propose, propose), grpc::StatusCode::INVALID_ARGUMENT,
                "from_node is node 3");
  ASSERT_NO_FATAL_FAILURE(CommitEverywhere(2));
  ASSERT_NO_FATAL_FAILURE(CommitEverywhere(3));
  ExpectRestores(3);
}

// A token higher than the coordinator's once raised every node's fence above it: the real
// coordinator was refused as "deposed" and no step committed again.
TEST_F(HostilePeerTest, AForgedTokenCannotFenceTheCoordinatorOut) {
  v1::PrepareRequest prepare;
  prepare.set_coordinator(1);
  prepare.set_step(kHuge);
  prepare.set_token(kHuge);
  prepare.set_timeout_ms(10);
  for (int node = 0; node < kNodes; ++node) {
    ExpectRefused(Call(node, &v1::Peer::Stub::Prepare, prepare),
                  grpc::StatusCode::FAILED_PRECONDITION, "etcd names node 0 as coordinator");
  }
  v1::EncodeRequest encode;
  encode.set_coordinator(2);
  encode.set_step(2);
  encode.set_token(kHuge);
  for (uint32_t id = 0; id < kNodes; ++id) {
    v1::NodeImage image;
    image.set_node_id(id);
    encode.add_group_images(image.SerializeAsString());
  }
  ExpectRefused(Call(1, &v1::Peer::Stub::Encode, encode), grpc::StatusCode::FAILED_PRECONDITION,
                "etcd names node 0 as coordinator");
  ASSERT_NO_FATAL_FAILURE(CommitEverywhere(2));
  ExpectRestores(2);
}

// Requests that once parked threads without limit, sized allocations and loops by what they said,
// or made a node push its data anywhere: each is refused by name, and the cluster goes on.
TEST_F(HostilePeerTest, UnboundedRequestsAreRefusedByName) {
  v1::PrepareRequest prepare;
  prepare.set_coordinator(0);
  prepare.set_step(2);
  prepare.set_token(1);
  prepare.set_timeout_ms(std::numeric_limits<uint32_t>::max());
  ExpectRefused(Call(1, &v1::Peer::Stub::Prepare, prepare), grpc::StatusCode::INVALID_ARGUMENT,
                "above the job's commit timeout of 3000 ms");

  v1::EncodeRequest encode;
  encode.set_coordinator(0);
  encode.set_step(2);
  encode.set_token(1);
  for (uint32_t id = 0; id < kNodes; ++id) {
    v1::NodeImage image;
    image.set_node_id(id);
    image.set_bytes(std::numeric_limits<uint64_t>::max());
    encode.add_group_images(image.SerializeAsString());
  }
  ExpectRefused(Call(1, &v1::Peer::Stub::Encode, encode), grpc::StatusCode::INVALID_ARGUMENT,
                "this node's pool could hold parity for");
  encode.mutable_group_images()->RemoveLast();
  ExpectRefused(Call(1, &v1::Peer::Stub::Encode, encode), grpc::StatusCode::INVALID_ARGUMENT,
                "2 images for a group of 3");

  v1::SendUnitsRequest units;
  units.set_to_node(7);
  units.set_step(1);
  ExpectRefused(Call(1, &v1::Peer::Stub::SendUnits, units), grpc::StatusCode::INVALID_ARGUMENT,
                "to_node is node 7");
  units.set_to_node(0);
  ExpectRefused(Call(1, &v1::Peer::Stub::SendUnits, units), grpc::StatusCode::INVALID_ARGUMENT,
                "request token 0");
  units.set_request(1);
  for (int i = 0; i < 100000; ++i) {
    v1::UnitRef* unit = units.add_units();
    unit->set_stripe(0);
    unit->set_unit(1);
  }
  ExpectRefused(Call(1, &v1::Peer::Stub::SendUnits, units), grpc::StatusCode::INVALID_ARGUMENT,
                "asked for twice");
  units.clear_units();
  v1::UnitRef* far = units.add_units();
  far->set_stripe(std::numeric_limits<uint64_t>::max());
  far->set_unit(0);
  ExpectRefused(Call(1, &v1::Peer::Stub::SendUnits, units), grpc::StatusCode::INVALID_ARGUMENT,
                "stripes");

  ASSERT_NO_FATAL_FAILURE(CommitEverywhere(2));
  ExpectRestores(2);
}

// Writes `header` (its length and CRC filled from `payload`) and `payload` to the data plane on
// `port`; whether the daemon then closed the connection.
bool ClosesTheConnection(uint16_t port, daemon::FrameHeader header,
                         const std::vector<uint8_t>& payload) {
  namespace asio = boost::asio;
  asio::io_context io;
  header.length = static_cast<uint32_t>(payload.size());
  header.payload_crc = erasure::Crc32c(payload.data(), payload.size());
  uint8_t bytes[daemon::FrameHeader::kBytes];
  daemon::EncodeFrameHeader(header, bytes);
  asio::ip::tcp::socket socket(io);
  socket.connect({asio::ip::make_address("127.0.0.1"), port});
  asio::write(socket, std::array<asio::const_buffer, 3>{asio::buffer(bytes),
                                                        asio::buffer(header.region),
                                                        asio::buffer(payload)});
  // The daemon closes the connection: the socket turns readable and the read ends (it never
  // writes on the data plane). Still not readable after 30 s: the connection was kept.
  pollfd readable{.fd = socket.native_handle(), .events = POLLIN, .revents = 0};
  if (poll(&readable, 1, 30000) != 1) return false;
  uint8_t byte;
  return recv(socket.native_handle(), &byte, 1, 0) <= 0;
}

// Frames whose offset wraps past 2^64, or that no one asked for, written to every daemon's data
// plane: refused, the connection closed, nothing stored touched.
TEST_F(HostilePeerTest, HostileFramesNeverReachStoredData) {
  const std::vector<uint8_t> payload(64, 0xab);
  for (int node = 0; node < kNodes; ++node) {
    for (daemon::FrameKind kind : {daemon::FrameKind::kParityDelta,
                                   daemon::FrameKind::kFetchedUnit,
                                   daemon::FrameKind::kFetchedRegion}) {
      daemon::FrameHeader header;
      header.kind = kind;
      header.step = 1;
      // A fetched frame names the request it answers: one the receiver never made.
      header.attempt = kind == daemon::FrameKind::kParityDelta
                           ? 1
                           : std::numeric_limits<int64_t>::max();
      header.stripe = 0;
      header.offset = std::numeric_limits<uint64_t>::max() - 63;
      header.region = kind == daemon::FrameKind::kFetchedRegion ? "weights" : "";
      EXPECT_TRUE(ClosesTheConnection(data_ports_[node], header, payload))
          << "node " << node << " kept a connection with a hostile frame open";
    }
    // Counted, and the last shown with its reason.
    const v1::ClusterStatusResponse status = Status(node);
    EXPECT_EQ(status.data_connections_closed(), 3u) << "node " << node;
    EXPECT_TRUE(absl::StrContains(status.last_data_connection_closed(), "127.0.0.1: "))
        << status.last_data_connection_closed();
    absl::StatusOr<testing::HttpReply> metrics =
        testing::HttpGet(daemons_[node]->http_port(), "/metrics");
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    EXPECT_TRUE(absl::StrContains(metrics->body, "\nmoesnap_data_connections_closed_total 3\n"))
        << metrics->body;
  }
  ASSERT_NO_FATAL_FAILURE(CommitEverywhere(2));
  ExpectRestores(2);
}

// Requests for committed regions whose answer would go to a node outside the job, that do not
// carry the asking node's id, or that name their regions outside a request's bounds, and refusals
// longer than a reason may be: refused, the connection closed. The job goes on committing.
TEST_F(HostilePeerTest, HostileRegionRequestsAndRefusalsCloseTheConnection) {
  auto payload = [](uint32_t asking, std::vector<absl::string_view> regions) {
    absl::StatusOr<std::vector<uint8_t>> bytes = daemon::EncodeRegionRequest(asking, regions);
    EXPECT_OK(bytes);
    return bytes.value_or(std::vector<uint8_t>());
  };
  daemon::FrameHeader request;
  request.kind = daemon::FrameKind::kRegionRequest;
  request.step = 1;
  // The asking node's id, 0 regions.
  const std::vector<uint8_t> none = {0, 0, 0, 0, 0, 0};
  // One region whose name is longer than the bytes left.
  const std::vector<uint8_t> overlong = {0, 0, 0, 0, 1, 0, 9, 0, 'w', 'e'};
  for (int node = 0; node < kNodes; ++node) {
    EXPECT_TRUE(ClosesTheConnection(data_ports_[node], request, payload(1u << 31, {"weights"})))
        << "node " << node << " took a request answered to a node outside the job";
    EXPECT_TRUE(ClosesTheConnection(data_ports_[node], request, {0, 0, 0, 0, 0}))
        << "node " << node << " took a request without the asking node's id";
    EXPECT_TRUE(ClosesTheConnection(data_ports_[node], request, none))
        << "node " << node << " took a request naming no region";
    EXPECT_TRUE(ClosesTheConnection(data_ports_[node], request, overlong))
        << "node " << node << " took a request naming a region past its end";
    std::vector<uint8_t> twice = payload(0, {"weights"});
    const std::vector<uint8_t> name(twice.begin() + 6, twice.end());
    twice[4] = 2;
    twice.insert(twice.end(), name.begin(), name.end());
    EXPECT_TRUE(ClosesTheConnection(data_ports_[node], request, twice))
        << "node " << node << " took a request naming a region twice";
    daemon::FrameHeader named = request;
    named.region = "weights";
    EXPECT_TRUE(ClosesTheConnection(data_ports_[node], named, payload(0, {"weights"})))
        << "node " << node << " took a request naming a region in its header";
    daemon::FrameHeader refusal = request;
    refusal.kind = daemon::FrameKind::kRegionRefused;
    refusal.region = "weights";
    EXPECT_TRUE(ClosesTheConnection(data_ports_[node], refusal, std::vector<uint8_t>(1025, 'x')))
        << "node " << node << " took a refusal of 1025 bytes";
  }
  ASSERT_NO_FATAL_FAILURE(CommitEverywhere(2));
  ExpectRestores(2);
}

}  // namespace
}  // namespace moesnap
