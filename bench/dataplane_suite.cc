// The dataplane suite: why bulk chunks do not go over gRPC, and what mutual TLS costs. The same
// 4 MiB chunks moved over one loopback connection four ways in one run: a raw TCP stream (the
// limit), the data plane (framed, CRC-32C computed by the sender and checked by the receiver), the
// data plane with mutual TLS (certificates made by deploy/make-certs.sh, as a cluster runs it), and
// a gRPC client stream of protobuf `bytes` messages.
#include <grpcpp/grpcpp.h>

#include <stdlib.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "bench/aligned_buffer.h"
#include "bench/raw_tcp.h"
#include "bench/stream.grpc.pb.h"
#include "bench/suites.h"
#include "bench/timing.h"
#include "absl/strings/str_cat.h"
#include "daemon/data_plane.h"

namespace moesnap::bench {
namespace {

constexpr size_t kChunkBytes = 4 << 20;
constexpr int kChunksPerCall = 16;  // 64 MiB per timed call
constexpr size_t kBytesPerCall = kChunkBytes * kChunksPerCall;

void WaitFor(const std::atomic<uint64_t>& received, uint64_t target) {
  while (received.load(std::memory_order_acquire) < target) std::this_thread::yield();
}

class CountingSink : public daemon::FrameSink {
 public:
  absl::Status Accept(const daemon::FrameHeader&, absl::Span<const uint8_t> payload,
                      std::optional<uint32_t> /*sender*/) override {
    received += payload.size();
    return absl::OkStatus();
  }
  std::atomic<uint64_t> received{0};
};

// Certificates of a two-node job, made by the operators' script in a temporary folder.
class BenchCertificates {
 public:
  BenchCertificates() {
    char directory[] = "/tmp/moesnap-bench-certs-XXXXXX";
    directory_ = mkdtemp(directory);
  }
  ~BenchCertificates() {
    std::error_code ignored;
    std::filesystem::remove_all(directory_, ignored);
  }
  absl::StatusOr<std::shared_ptr<const daemon::PeerTls>> Node(uint32_t node) {
    if (!made_) {
      const std::string command = absl::StrCat("'", MOESNAP_SOURCE_DIR, "/deploy/make-certs.sh' '",
                                                directory_, "' bench 2 >/dev/null");
      if (std::system(command.c_str()) != 0) {
        return absl::InternalError(absl::StrCat("'", command, "' failed"));
      }
      made_ = true;
    }
    return daemon::PeerTls::Load({.ca_file = directory_ + "/ca.pem",
                                  .cert_file = absl::StrCat(directory_, "/node-", node, ".pem"),
                                  .key_file = absl::StrCat(directory_, "/node-", node, ".key")},
                                 "bench", node, 2);
  }

 private:
  std::string directory_;
  bool made_ = false;
};

class ChunkStreamService final : public ChunkStream::Service {
 public:
  grpc::Status Send(grpc::ServerContext*, grpc::ServerReader<Chunk>* reader,
                    StreamSummary* summary) override {
    Chunk chunk;
    uint64_t bytes = 0;
    while (reader->Read(&chunk)) bytes += chunk.payload().size();
    summary->set_bytes(bytes);
    return grpc::Status::OK;
  }
};

}  // namespace

absl::Status RunDataPlaneSuite(Report& report) {
  AlignedBuffer chunk(kChunkBytes, 0x6b);

  // Raw TCP, one stream.
  RawTcpStream raw(kChunkBytes);
  auto raw_body = [&] { raw.Send(chunk.data(), kChunksPerCall); };

  // The data plane, one connection.
  CountingSink sink;
  absl::StatusOr<std::unique_ptr<daemon::DataPlaneServer>> server =
      daemon::DataPlaneServer::Start({.host = "127.0.0.1", .port = 0}, &sink);
  if (!server.ok()) return server.status();
  absl::StatusOr<std::unique_ptr<daemon::DataPlaneClient>> client =
      daemon::DataPlaneClient::Connect("127.0.0.1", (*server)->port(), 1);
  if (!client.ok()) return client.status();
  absl::Status status;
  uint64_t frames_sent = 0;
  auto data_plane_body = [&] {
    for (int i = 0; i < kChunksPerCall; ++i) {
      daemon::FrameHeader header;
      header.stripe = static_cast<uint64_t>(i);
      header.region = "bench";
      status.Update((*client)->Send(header, absl::MakeConstSpan(chunk.data(), kChunkBytes)));
    }
    frames_sent += kBytesPerCall;
    WaitFor(sink.received, frames_sent);
  };

  // The data plane with mutual TLS: node 1 sends to node 0.
  BenchCertificates certificates;
  absl::StatusOr<std::shared_ptr<const daemon::PeerTls>> receiver_tls = certificates.Node(0);
  if (!receiver_tls.ok()) return receiver_tls.status();
  absl::StatusOr<std::shared_ptr<const daemon::PeerTls>> sender_tls = certificates.Node(1);
  if (!sender_tls.ok()) return sender_tls.status();
  CountingSink tls_sink;
  absl::StatusOr<std::unique_ptr<daemon::DataPlaneServer>> tls_server =
      daemon::DataPlaneServer::Start({.host = "127.0.0.1", .port = 0, .tls = *receiver_tls},
                                     &tls_sink);
  if (!tls_server.ok()) return tls_server.status();
  absl::StatusOr<std::unique_ptr<daemon::DataPlaneClient>> tls_client =
      daemon::DataPlaneClient::Connect("127.0.0.1", (*tls_server)->port(), 1, absl::Seconds(30),
                                       {*sender_tls, 0});
  if (!tls_client.ok()) return tls_client.status();
  uint64_t tls_frames_sent = 0;
  auto tls_body = [&] {
    for (int i = 0; i < kChunksPerCall; ++i) {
      daemon::FrameHeader header;
      header.stripe = static_cast<uint64_t>(i);
      header.region = "bench";
      status.Update((*tls_client)->Send(header, absl::MakeConstSpan(chunk.data(), kChunkBytes)));
    }
    tls_frames_sent += kBytesPerCall;
    WaitFor(tls_sink.received, tls_frames_sent);
  };

  // gRPC client streaming over TCP on loopback.
  ChunkStreamService service;
  int grpc_port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &grpc_port);
  builder.SetMaxReceiveMessageSize(2 * kChunkBytes);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> grpc_server = builder.BuildAndStart();
  if (grpc_server == nullptr) return absl::InternalError("cannot start the gRPC benchmark server");
  auto stub = ChunkStream::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", grpc_port),
                                                       grpc::InsecureChannelCredentials()));
  auto grpc_body = [&] {
    grpc::ClientContext context;
    StreamSummary summary;
    std::unique_ptr<grpc::ClientWriter<Chunk>> writer = stub->Send(&context, &summary);
    Chunk message;
    for (int i = 0; i < kChunksPerCall; ++i) {
      message.set_payload(chunk.data(), kChunkBytes);  // what a caller with a buffer must do
      writer->Write(message);
    }
    writer->WritesDone();
    const grpc::Status finished = writer->Finish();
    if (!finished.ok() || summary.bytes() != kBytesPerCall) {
      status.Update(absl::InternalError("gRPC stream lost bytes: " + finished.error_message()));
    }
  };

  const TimingOptions options{.min_seconds_per_repetition = 0.5, .repetitions = 5};
  const Comparison data_plane = CompareGigabytesPerSecond(data_plane_body, raw_body, kBytesPerCall, options);
  const Comparison tls = CompareGigabytesPerSecond(tls_body, data_plane_body, kBytesPerCall, options);
  const Comparison grpc_stream = CompareGigabytesPerSecond(grpc_body, raw_body, kBytesPerCall, options);
  if (!status.ok()) return status;
  report.Add({"dataplane", "data plane, 1 connection, 4 MiB frames (+CRC)", data_plane.value, "GB/s",
              "raw TCP stream on loopback", data_plane.baseline, data_plane.value / data_plane.baseline});
  report.Add({"dataplane", "data plane with mutual TLS, 1 connection, 4 MiB frames (+CRC)", tls.value,
              "GB/s", "the plaintext data plane, same repetitions", tls.baseline,
              tls.value / tls.baseline});
  report.Add({"dataplane", "gRPC client stream, 4 MiB bytes messages", grpc_stream.value, "GB/s",
              "raw TCP stream on loopback", grpc_stream.baseline,
              grpc_stream.value / grpc_stream.baseline});
  report.AddNote("dataplane",
                 "One connection each on 127.0.0.1, 64 MiB per timed call, the receiver's count "
                 "awaited before the call ends. The data plane computes CRC-32C on both ends; gRPC "
                 "copies each chunk into a protobuf message and through its HTTP/2 framing, which "
                 "is why bulk chunks travel on the data plane and gRPC carries control only. "
                 "Mutual TLS: EC P-256 certificates of deploy/make-certs.sh, the cipher OpenSSL "
                 "negotiates (TLS 1.3, AES-GCM with AES-NI where the CPU has it), the connection's "
                 "handshake outside the timed calls; compared with the plaintext data plane in "
                 "alternating repetitions of the same run.");

  grpc_server->Shutdown();
  return absl::OkStatus();
}

}  // namespace moesnap::bench
