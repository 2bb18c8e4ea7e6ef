// The bulk data plane between daemons: frames (daemon/frame.h) over plain TCP with Boost.Asio.
// gRPC carries only control messages: a plaintext gRPC stream copies every `bytes` field through
// protobuf and tops out well below what a raw socket moves (bench: `moesnap-bench dataplane`).
//
// The receiver reads a header, validates it, reads the region name and payload into a buffer, checks
// the payload CRC and only then hands the frame to the sink. Anything malformed closes the connection
// with a logged reason; no byte of a rejected frame reaches the sink. Connections are bounded in
// number, every read and write in time; the accept loop outlives any error (out of descriptors,
// threads or memory) and backs off instead of spinning. Senders keep several
// connections per peer and write header, name and payload with one gather write.
//
// With a PeerTls (mutual TLS), every connection starts with a TLS handshake in which both ends
// present a certificate of the job's CA; the server takes frames only from a certificate naming
// this job and one of its nodes, and answers one byte once it accepted the peer, so a client learns
// of a refusal at connect rather than at its first frame; the client checks that the server's
// certificate names the node it meant to reach. Refusals are counted (RecordPeerRefusal).
#ifndef MOESNAP_DAEMON_DATA_PLANE_H_
#define MOESNAP_DAEMON_DATA_PLANE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/frame.h"
#include "daemon/peer_tls.h"

namespace moesnap::daemon {

struct DataPlaneOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0: any free port
  uint32_t max_payload_bytes = 4 << 20;
  // Connections served at once (each a thread and a buffer of up to max_payload_bytes); one more
  // is closed at once and counted in connections_rejected.
  uint32_t max_connections = 256;
  // Once a frame's header has begun, the whole frame must arrive within this time.
  absl::Duration frame_timeout = absl::Seconds(30);
  // A connection with no frame for this long is closed (its sender reconnects on its next frame).
  absl::Duration idle_timeout = absl::Minutes(10);
  // Mutual TLS with the job's peers; null: plaintext.
  std::shared_ptr<const PeerTls> tls = nullptr;
  // A connection's TLS handshake must end within this time.
  absl::Duration handshake_timeout = absl::Seconds(10);
};

// Mutual TLS on a client's connections: this node's PeerTls (null: plaintext) and the node the
// client expects to reach (the server's certificate must name it).
struct DataPlaneClientTls {
  std::shared_ptr<const PeerTls> tls;
  uint32_t peer_node = 0;
};

// Receives accepted frames. Called from the connection's thread; must be thread-safe. A non-OK
// return closes the connection (the sender sees its next write fail). `sender` is the node the
// connection's certificate names (mutual TLS); nullopt on a plaintext connection, whose peer may
// claim to be any node.
//
// A frame's payload is read either into the connection's buffer, checked (length, CRC-32C) and then
// given to Accept, so no byte of a refused frame reaches the sink; or, where Reserve names memory of
// the sink's for it, straight into that memory, checked there (unless the memory's owner checks it
// itself), and then reported to Filled: on a failed check or read the bytes there are garbage and
// the sink must treat them so.
class FrameSink {
 public:
  // Memory of the sink's that a frame's payload is read into.
  struct InPlace {
    absl::Span<uint8_t> bytes;  // exactly header.length bytes
    // The memory's owner checks every byte read into it against checksums of its own (an elastic
    // restore, against the region's stored chunk CRCs as it writes them into the rank, decoding
    // the region from its group when they differ; a rebuild, its whole new image against its
    // chunk CRCs before installing it): the frame's CRC-32C is not checked as it lands, a pass
    // over the bytes saved.
    bool owner_checks = false;
    // No memory of the sink's (`bytes` empty): the payload is read and dropped unchecked, and
    // neither Filled nor Accept is called. For a frame the sink asked for but no longer awaits.
    bool drop = false;
  };
  virtual ~FrameSink() = default;
  // Where to read the frame's payload, held for it until Filled (unless dropped); nullopt: the
  // connection's buffer, then Accept. An error closes the connection.
  virtual absl::StatusOr<std::optional<InPlace>> Reserve(const FrameHeader& /*header*/,
                                                         std::optional<uint32_t> /*sender*/) {
    return std::nullopt;
  }
  // The payload read into reserved memory passed its checks (OK) or did not (why).
  virtual void Filled(const FrameHeader& /*header*/, const absl::Status& /*checked*/) {}
  virtual absl::Status Accept(const FrameHeader& header, absl::Span<const uint8_t> payload,
                              std::optional<uint32_t> sender) = 0;
  // The server closed a connection over `why` (a frame malformed, damaged, refused or cut short):
  // whatever the peer wrote on it after that frame is lost. `sender`: the peer's node, known only
  // on an authenticated connection; `address`: the peer's IP address.
  virtual void ConnectionClosed(std::optional<uint32_t> /*sender*/,
                                const std::string& /*address*/, const absl::Status& /*why*/) {}
};

class DataPlaneServer {
 public:
  static absl::StatusOr<std::unique_ptr<DataPlaneServer>> Start(const DataPlaneOptions& options,
                                                                FrameSink* sink);
  ~DataPlaneServer();  // closes the listener and every connection, joins their threads

  uint16_t port() const { return port_; }
  uint64_t frames_accepted() const { return frames_accepted_; }
  uint64_t connections_rejected() const { return connections_rejected_; }
  // Connections being served now.
  uint64_t connections_open() const;

 private:
  struct Impl;
  explicit DataPlaneServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  uint16_t port_ = 0;
  std::atomic<uint64_t> frames_accepted_{0};
  std::atomic<uint64_t> connections_rejected_{0};
};

// Frames to one peer over `connections` TCP connections. Send is thread-safe; concurrent senders use
// different connections. A failed connection is reconnected on its next use. A frame the peer does
// not take within `send_timeout` (it stopped reading: paused, or hostile) fails the send.
class DataPlaneClient {
 public:
  // `host`: an IP address or a host name.
  static absl::StatusOr<std::unique_ptr<DataPlaneClient>> Connect(
      const std::string& host, uint16_t port, int connections,
      absl::Duration send_timeout = absl::Seconds(30), DataPlaneClientTls tls = {});
  ~DataPlaneClient();

  // Sends a frame that SealFrame filled from `pieces` in one gather write (no copy of the pieces).
  absl::Status SendSealed(const FrameHeader& header,
                          absl::Span<const absl::Span<const uint8_t>> pieces);
  // SealFrame, then SendSealed.
  absl::Status Send(FrameHeader header, absl::Span<const absl::Span<const uint8_t>> pieces);
  absl::Status Send(FrameHeader header, absl::Span<const uint8_t> payload) {
    return Send(std::move(header), {&payload, 1});
  }

 private:
  struct Impl;
  explicit DataPlaneClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_DATA_PLANE_H_
