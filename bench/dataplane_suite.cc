// The dataplane suite: why bulk chunks do not go over gRPC. The same 4 MiB chunks moved over one
// loopback connection three ways in one run: a raw TCP stream (the limit), the data plane (framed,
// CRC-32C computed by the sender and checked by the receiver), and a gRPC client stream of protobuf
// `bytes` messages.
#include <grpcpp/grpcpp.h>

#include <atomic>
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
  absl::Status Accept(const daemon::FrameHeader&, absl::Span<const uint8_t> payload) override {
    received += payload.size();
    return absl::OkStatus();
  }
  std::atomic<uint64_t> received{0};
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
  const Comparison grpc_stream = CompareGigabytesPerSecond(grpc_body, raw_body, kBytesPerCall, options);
  if (!status.ok()) return status;
  report.Add({"dataplane", "data plane, 1 connection, 4 MiB frames (+CRC)", data_plane.value, "GB/s",
              "raw TCP stream on loopback", data_plane.baseline, data_plane.value / data_plane.baseline});
  report.Add({"dataplane", "gRPC client stream, 4 MiB bytes messages", grpc_stream.value, "GB/s",
              "raw TCP stream on loopback", grpc_stream.baseline,
              grpc_stream.value / grpc_stream.baseline});
  report.AddNote("dataplane",
                 "One connection each on 127.0.0.1, 64 MiB per timed call, the receiver's count "
                 "awaited before the call ends. The data plane computes CRC-32C on both ends; gRPC "
                 "copies each chunk into a protobuf message and through its HTTP/2 framing, which "
                 "is why bulk chunks travel on the data plane and gRPC carries control only.");

  grpc_server->Shutdown();
  return absl::OkStatus();
}

}  // namespace moesnap::bench
