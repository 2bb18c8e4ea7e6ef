// Mutual TLS between real daemons: a three-node job (k = 2, m = 1) whose daemons reach each other
// and etcd with mutual TLS, every certificate made by deploy/make-certs.sh. A peer that presents no
// certificate, one of another CA, an expired one, one of another job or of a node outside the job,
// or a valid one acting as another node, is refused on the Peer service and on the data plane (real
// ports, real sockets), and each refusal is counted in /metrics and in `cluster status`; a valid
// certificate is let in, and the job goes on committing steps and restoring them byte for byte.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/moesnap.grpc.pb.h"
#include "tests/testing/child_process.h"
#include "tests/testing/etcd_process.h"
#include "tests/testing/http_client.h"
#include "tests/testing/job_certificates.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::BinaryPath;
using testing::ChildProcess;
using testing::JobCertificates;
using testing::TestDaemon;
using testing::TestDaemonOptions;
using namespace std::chrono_literals;
namespace asio = boost::asio;

constexpr int kNodes = 3;
constexpr char kJob[] = "mtls-test";

std::string Read(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// What a client presents: the CA it trusts and its certificate and key (empty: none).
struct Credentials {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
};

class MutualTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<JobCertificates>> certificates =
        JobCertificates::Make(kJob, kNodes);
    ASSERT_TRUE(certificates.ok()) << certificates.status();
    job_ = *std::move(certificates);
    testing::EtcdCluster::Options etcd_options;
    job_->ServeEtcd(&etcd_options);
    absl::StatusOr<std::unique_ptr<testing::EtcdCluster>> etcd =
        testing::EtcdCluster::Start(etcd_options);
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = *std::move(etcd);
    const std::string config = absl::StrCat(
        "[cluster]\njob = \"", kJob, "\"\nnode_count = ", kNodes,
        "\ndata_units = 2\nparity_units = 1\nstripe_unit_bytes = \"64KiB\"\n"
        "lease_ttl_ms = 2000\ncommit_timeout_ms = 10000\netcd_endpoints = [\"",
        absl::StrJoin(etcd_->endpoints(), "\", \""), "\"]\nadvertise_host = \"127.0.0.1\"\n",
        "control_port = 0\ndata_port = 0\n", job_->TlsSection());
    for (int id = 0; id < kNodes; ++id) {
      daemons_.push_back(std::make_unique<TestDaemon>(TestDaemonOptions{
          .pool_bytes = "64MiB", .node_id = static_cast<uint32_t>(id), .extra_config = config}));
      ASSERT_TRUE(daemons_.back()->Start());
    }
    WaitForCluster();
    const v1::ClusterStatusResponse status = Status(0);
    for (const v1::ClusterNodeStatus& node : status.nodes()) {
      control_ports_[node.node_id()] = static_cast<uint16_t>(node.control_port());
      data_ports_[node.node_id()] = static_cast<uint16_t>(node.data_port());
    }
    ASSERT_TRUE(status.peer_tls());
  }

  v1::ClusterStatusResponse Status(int node) {
    auto stub = v1::Admin::NewStub(grpc::CreateChannel("unix:" + daemons_[node]->admin_socket(),
                                                       grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 5s);
    v1::ClusterStatusResponse response;
    const grpc::Status status = stub->ClusterStatus(&context, {}, &response);
    EXPECT_TRUE(status.ok()) << "node " << node << ": " << status.error_message();
    return response;
  }

  void WaitForCluster() {
    for (int attempt = 0; attempt < 300; ++attempt) {
      bool settled = true;
      for (int node = 0; node < kNodes && settled; ++node) {
        int seen = 0;
        const v1::ClusterStatusResponse status = Status(node);
        for (const v1::ClusterNodeStatus& peer : status.nodes()) {
          if (peer.live() && peer.answered() && !peer.rebuilding()) ++seen;
        }
        settled = seen == kNodes;
      }
      if (settled) return;
      std::this_thread::sleep_for(100ms);
    }
    FAIL() << "the cluster did not settle";
  }

  // A Peer stub to node 0 presenting `credentials`, expecting node 0's certificate.
  std::unique_ptr<v1::Peer::Stub> PeerStub(const Credentials& credentials) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = Read(credentials.ca_file);
    if (!credentials.cert_file.empty()) {
      ssl.pem_cert_chain = Read(credentials.cert_file);
      ssl.pem_private_key = Read(credentials.key_file);
    }
    grpc::ChannelArguments arguments;
    arguments.SetSslTargetNameOverride(absl::StrCat("node-0.", kJob, ".moesnap"));
    return v1::Peer::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", control_ports_[0]), grpc::SslCredentials(ssl), arguments));
  }

  grpc::Status Describe(v1::Peer::Stub& stub) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    v1::NodeReport report;
    return stub.Describe(&context, {}, &report);
  }

  // Connects to node 0's data plane with `credentials` (TLS); true when node 0 let the connection
  // in (answered its acceptance byte), false when it closed it.
  bool DataPlaneAdmits(const Credentials& credentials) {
    asio::io_context io;
    asio::ssl::context context(asio::ssl::context::tls_client);
    context.load_verify_file(credentials.ca_file);
    context.set_verify_mode(asio::ssl::verify_peer);
    if (!credentials.cert_file.empty()) {
      context.use_certificate_chain_file(credentials.cert_file);
      context.use_private_key_file(credentials.key_file, asio::ssl::context::pem);
    }
    asio::ssl::stream<asio::ip::tcp::socket> stream(io, context);
    stream.lowest_layer().connect({asio::ip::make_address("127.0.0.1"), data_ports_[0]});
    boost::system::error_code error;
    stream.handshake(asio::ssl::stream_base::client, error);
    if (error) return false;
    uint8_t answer = 0;
    // The daemon answers or closes within its handshake timeout.
    asio::read(stream, asio::buffer(&answer, 1), error);
    return !error && answer == 1;
  }

  // moesnap_peer_refusals_total{plane, reason} on node 0.
  uint64_t Refusals(const std::string& plane, const std::string& reason) {
    absl::StatusOr<testing::HttpReply> reply = testing::HttpGet(daemons_[0]->http_port(), "/metrics");
    EXPECT_TRUE(reply.ok()) << reply.status();
    if (!reply.ok()) return 0;
    const std::string series = absl::StrCat("moesnap_peer_refusals_total{plane=\"", plane,
                                            "\",reason=\"", reason, "\"} ");
    for (absl::string_view line : absl::StrSplit(reply->body, '\n')) {
      if (!absl::StartsWith(line, series)) continue;
      double value = 0;
      EXPECT_TRUE(absl::SimpleAtod(line.substr(series.size()), &value)) << line;
      return static_cast<uint64_t>(value);
    }
    return 0;
  }

  // The data plane counts a refusal once its side of the handshake has failed, which may be after
  // the client saw the handshake fail: the count is read until it reaches `expected` (or 10 s
  // passed), and the last one read is returned.
  uint64_t DataPlaneRefusals(const std::string& reason, uint64_t expected) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    uint64_t count = Refusals("data", reason);
    while (count < expected && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
      count = Refusals("data", reason);
    }
    return count;
  }

  // Trains `steps` steps on every node and restores each node's newest one byte for byte.
  void TrainAndVerify(int steps) {
    std::vector<std::unique_ptr<ChildProcess>> trainers;
    for (int node = 0; node < kNodes; ++node) {
      trainers.push_back(std::make_unique<ChildProcess>(std::vector<std::string>{
          BinaryPath("moesnap-test-trainer"), "--socket", daemons_[node]->agent_socket(), "--rank",
          std::to_string(node), "--mode", "train", "--regions", "3", "--region-bytes", "100000",
          "--steps", std::to_string(steps)}));
    }
    for (auto& trainer : trainers) ASSERT_EQ(trainer->Wait(120s), 0);
    for (int node = 0; node < kNodes; ++node) {
      ChildProcess verify({BinaryPath("moesnap-test-trainer"), "--socket",
                           daemons_[node]->agent_socket(), "--rank", std::to_string(node),
                           "--mode", "verify", "--regions", "3", "--region-bytes", "100000",
                           "--steps", std::to_string(steps)});
      ASSERT_EQ(verify.Wait(60s), 0) << "node " << node;
    }
  }

  std::unique_ptr<JobCertificates> job_;
  std::unique_ptr<testing::EtcdCluster> etcd_;
  std::vector<std::unique_ptr<TestDaemon>> daemons_;
  std::map<uint32_t, uint16_t> control_ports_;
  std::map<uint32_t, uint16_t> data_ports_;
};

TEST_F(MutualTlsTest, ThePeerServiceRefusesAnyoneButANodeOfTheJobActingAsItself) {
  const Credentials node1{job_->ca_file(), job_->cert_file(1), job_->key_file(1)};
  // A node of the job is let in (the check can pass, so its refusals below mean something).
  const grpc::Status admitted = Describe(*PeerStub(node1));
  EXPECT_TRUE(admitted.ok()) << admitted.error_message();

  const grpc::Status anonymous = Describe(*PeerStub({job_->ca_file(), "", ""}));
  EXPECT_EQ(anonymous.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(absl::StrContains(anonymous.error_message(), "presented no certificate"))
      << anonymous.error_message();

  absl::StatusOr<std::unique_ptr<JobCertificates>> stranger = JobCertificates::Make(kJob, kNodes);
  ASSERT_TRUE(stranger.ok()) << stranger.status();
  const grpc::Status foreign =
      Describe(*PeerStub({job_->ca_file(), (*stranger)->cert_file(1), (*stranger)->key_file(1)}));
  EXPECT_EQ(foreign.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(absl::StrContains(foreign.error_message(), "does not check against job"))
      << foreign.error_message();

  absl::StatusOr<std::unique_ptr<JobCertificates>> expired =
      job_->SameCa(kJob, kNodes, {"--days", "-1"});
  ASSERT_TRUE(expired.ok()) << expired.status();
  const grpc::Status old =
      Describe(*PeerStub({job_->ca_file(), (*expired)->cert_file(1), (*expired)->key_file(1)}));
  EXPECT_EQ(old.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(absl::StrContains(old.error_message(), "expired")) << old.error_message();

  absl::StatusOr<std::unique_ptr<JobCertificates>> other_job = job_->SameCa("other-job", kNodes);
  ASSERT_TRUE(other_job.ok()) << other_job.status();
  const grpc::Status other = Describe(
      *PeerStub({job_->ca_file(), (*other_job)->cert_file(1), (*other_job)->key_file(1)}));
  EXPECT_EQ(other.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(absl::StrContains(other.error_message(), "names job 'other-job'"))
      << other.error_message();

  // Node 1 proposing as node 2, and coordinating as node 2.
  std::unique_ptr<v1::Peer::Stub> as_node1 = PeerStub(node1);
  {
    grpc::ClientContext context;
    v1::ProposeRequest request;
    request.set_from_node(2);
    request.set_step(1);
    v1::ProposeResponse response;
    const grpc::Status status = as_node1->Propose(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_TRUE(absl::StrContains(status.error_message(),
                                  "names node 1 and the request acts as node 2 (from_node)"))
        << status.error_message();
  }
  {
    grpc::ClientContext context;
    v1::PrepareRequest request;
    request.set_coordinator(2);
    request.set_step(1);
    request.set_token(1);
    v1::PrepareResponse response;
    const grpc::Status status = as_node1->Prepare(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_TRUE(absl::StrContains(status.error_message(), "(coordinator)")) << status.error_message();
  }
  {
    grpc::ClientContext context;
    v1::SendUnitsRequest request;
    request.set_to_node(2);
    v1::SendUnitsResponse response;
    const grpc::Status status = as_node1->SendUnits(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }

  // Plaintext does not reach the service at all.
  auto plaintext = v1::Peer::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", control_ports_[0]), grpc::InsecureChannelCredentials()));
  EXPECT_EQ(Describe(*plaintext).error_code(), grpc::StatusCode::UNAVAILABLE);

  EXPECT_EQ(Refusals("control", "no_certificate"), 1u);
  EXPECT_EQ(Refusals("control", "untrusted_certificate"), 2u);
  EXPECT_EQ(Refusals("control", "other_job"), 1u);
  EXPECT_EQ(Refusals("control", "other_node"), 3u);
  const v1::ClusterStatusResponse status = Status(0);
  EXPECT_GE(status.peer_refusals(), 7u);
  EXPECT_TRUE(absl::StrContains(status.last_peer_refusal(), "Peer service")) << status.last_peer_refusal();

  // Every refusal left the job whole: it commits and restores byte for byte.
  TrainAndVerify(3);
}

TEST_F(MutualTlsTest, TheDataPlaneRefusesAnyoneButANodeOfTheJob) {
  EXPECT_TRUE(DataPlaneAdmits({job_->ca_file(), job_->cert_file(2), job_->key_file(2)}));

  EXPECT_FALSE(DataPlaneAdmits({job_->ca_file(), "", ""}));
  EXPECT_EQ(DataPlaneRefusals("no_certificate", 1u), 1u);

  absl::StatusOr<std::unique_ptr<JobCertificates>> stranger = JobCertificates::Make(kJob, kNodes);
  ASSERT_TRUE(stranger.ok()) << stranger.status();
  EXPECT_FALSE(
      DataPlaneAdmits({job_->ca_file(), (*stranger)->cert_file(1), (*stranger)->key_file(1)}));
  absl::StatusOr<std::unique_ptr<JobCertificates>> expired =
      job_->SameCa(kJob, kNodes, {"--days", "-1"});
  ASSERT_TRUE(expired.ok()) << expired.status();
  EXPECT_FALSE(DataPlaneAdmits({job_->ca_file(), (*expired)->cert_file(1), (*expired)->key_file(1)}));
  EXPECT_EQ(DataPlaneRefusals("untrusted_certificate", 2u), 2u);

  absl::StatusOr<std::unique_ptr<JobCertificates>> other_job = job_->SameCa("other-job", kNodes);
  ASSERT_TRUE(other_job.ok()) << other_job.status();
  EXPECT_FALSE(
      DataPlaneAdmits({job_->ca_file(), (*other_job)->cert_file(1), (*other_job)->key_file(1)}));
  EXPECT_EQ(DataPlaneRefusals("other_job", 1u), 1u);

  // The job's CA, this job, a node id the job does not have.
  absl::StatusOr<std::unique_ptr<JobCertificates>> more = job_->SameCa(kJob, 8);
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_FALSE(DataPlaneAdmits({job_->ca_file(), (*more)->cert_file(7), (*more)->key_file(7)}));
  EXPECT_EQ(DataPlaneRefusals("other_node", 1u), 1u);

  // Plaintext frames never reach the frame decoder: the handshake fails first.
  {
    asio::io_context io;
    asio::ip::tcp::socket socket(io);
    socket.connect({asio::ip::make_address("127.0.0.1"), data_ports_[0]});
    const std::string frame(64, 'M');
    asio::write(socket, asio::buffer(frame));
    uint8_t byte = 0;
    boost::system::error_code error;
    asio::read(socket, asio::buffer(&byte, 1), error);
    EXPECT_TRUE(error) << "node 0 answered a plaintext peer";
  }
  EXPECT_EQ(DataPlaneRefusals("handshake", 1u), 1u);
  EXPECT_GE(Status(0).peer_refusals(), 6u);

  // The job's own transfers still pass: parity deltas on every commit.
  TrainAndVerify(3);
  const std::string status = [&] {
    ChildProcess ctl({BinaryPath("moesnapctl"), "--socket", daemons_[0]->admin_socket(), "cluster",
                      "status"});
    std::string output;
    while (std::optional<std::string> line = ctl.ReadLine(30s)) output += *line + "\n";
    EXPECT_EQ(ctl.Wait(30s), 0);
    return output;
  }();
  EXPECT_TRUE(absl::StrContains(status, "peers: mutual TLS")) << status;
  EXPECT_TRUE(absl::StrContains(status, "last peer refused: data plane")) << status;
}

}  // namespace
}  // namespace moesnap
