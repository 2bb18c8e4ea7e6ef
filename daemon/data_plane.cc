// DataPlaneServer and DataPlaneClient over Boost.Asio with blocking sockets: one thread per
// connection keeps the receive path a straight loop (the connection count is peers x a few).
#include "daemon/data_plane.h"

#include <boost/asio.hpp>
#include <poll.h>

#include <list>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {

namespace asio = boost::asio;
using asio::ip::tcp;

struct DataPlaneServer::Impl {
  DataPlaneOptions options;
  FrameSink* sink = nullptr;
  DataPlaneServer* owner = nullptr;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::thread accept_thread;
  std::mutex mutex;  // guards connections
  struct Connection {
    std::shared_ptr<tcp::socket> socket;
    std::shared_ptr<std::atomic<bool>> finished;
    std::thread thread;
  };
  std::list<Connection> connections;
  std::atomic<bool> stopping{false};

  void AcceptLoop() {
    while (!stopping) {
      auto socket = std::make_shared<tcp::socket>(io);
      boost::system::error_code error;
      acceptor.accept(*socket, error);
      if (error || stopping) break;
      socket->set_option(tcp::no_delay(true), error);
      std::lock_guard<std::mutex> lock(mutex);
      // Reap connections that ended, so a long-lived daemon does not accumulate threads.
      for (auto it = connections.begin(); it != connections.end();) {
        if (*it->finished) {
          it->thread.join();
          it = connections.erase(it);
        } else {
          ++it;
        }
      }
      auto finished = std::make_shared<std::atomic<bool>>(false);
      connections.push_back({socket, finished, std::thread([this, socket, finished] {
                               Serve(*socket);
                               *finished = true;
                             })});
    }
  }

  // Reads frames until the peer closes or sends something malformed.
  void Serve(tcp::socket& socket) {
    std::vector<uint8_t> payload;
    uint8_t header_bytes[FrameHeader::kBytes];
    std::string peer = "a peer";
    boost::system::error_code error;
    const tcp::endpoint remote = socket.remote_endpoint(error);
    if (!error) peer = absl::StrCat(remote.address().to_string(), ":", remote.port());
    while (!stopping) {
      asio::read(socket, asio::buffer(header_bytes), error);
      if (error) return;  // closed between frames: the normal end of a connection
      absl::StatusOr<FrameHeader> header =
          DecodeFrameHeader(header_bytes, options.max_payload_bytes);
      absl::Status status = header.status();
      if (status.ok()) {
        payload.resize(header->length);
        std::array<asio::mutable_buffer, 2> rest = {asio::buffer(header->region),
                                                    asio::buffer(payload)};
        asio::read(socket, rest, error);
        if (error) {
          status = absl::DataLossError(absl::StrCat("connection closed inside a frame of ",
                                                    header->length, " bytes: ", error.message()));
        }
      }
      if (status.ok()) status = CheckFramePayload(*header, payload);
      if (status.ok()) status = sink->Accept(*header, payload);
      if (!status.ok()) {
        Log(LogLevel::kWarning, "data plane: closing the connection from ", peer, ": ",
            status.ToString());
        ++owner->connections_rejected_;
        socket.close(error);
        return;
      }
      ++owner->frames_accepted_;
    }
  }
};

DataPlaneServer::DataPlaneServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<DataPlaneServer>> DataPlaneServer::Start(
    const DataPlaneOptions& options, FrameSink* sink) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->sink = sink;
  boost::system::error_code error;
  const asio::ip::address address = asio::ip::make_address(options.host, error);
  if (error) {
    return absl::InvalidArgumentError(absl::StrCat("data plane host '", options.host,
                                                   "' is not an IP address"));
  }
  const tcp::endpoint endpoint(address, options.port);
  impl->acceptor.open(endpoint.protocol(), error);
  if (!error) impl->acceptor.set_option(tcp::acceptor::reuse_address(true), error);
  if (!error) impl->acceptor.bind(endpoint, error);
  if (!error) impl->acceptor.listen(asio::socket_base::max_listen_connections, error);
  if (error) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.host, ":", options.port,
                                               " for the data plane: ", error.message()));
  }
  std::unique_ptr<DataPlaneServer> server(new DataPlaneServer(std::move(impl)));
  server->impl_->owner = server.get();
  server->port_ = server->impl_->acceptor.local_endpoint().port();
  server->impl_->accept_thread = std::thread([raw = server->impl_.get()] { raw->AcceptLoop(); });
  return server;
}

DataPlaneServer::~DataPlaneServer() {
  impl_->stopping = true;
  boost::system::error_code error;
  // A blocking accept() is woken by shutting the listening socket down.
  ::shutdown(impl_->acceptor.native_handle(), SHUT_RDWR);
  impl_->accept_thread.join();
  impl_->acceptor.close(error);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (Impl::Connection& connection : impl_->connections) {
    connection.socket->shutdown(tcp::socket::shutdown_both, error);
  }
  for (Impl::Connection& connection : impl_->connections) connection.thread.join();
}

struct DataPlaneClient::Impl {
  std::string host;
  uint16_t port = 0;
  asio::io_context io;
  struct Connection {
    std::mutex mutex;
    std::unique_ptr<tcp::socket> socket;  // null until connected, or after a failure
  };
  std::vector<std::unique_ptr<Connection>> connections;
  std::atomic<uint64_t> next{0};

  // `host` is an IP address or a host name (a replacement node may advertise either); each of its
  // addresses is tried in turn.
  absl::Status Open(Connection& connection) {
    boost::system::error_code error;
    tcp::resolver resolver(io);
    const tcp::resolver::results_type addresses =
        resolver.resolve(host, std::to_string(port), tcp::resolver::numeric_service, error);
    if (error) {
      return absl::UnavailableError(absl::StrCat("cannot resolve the data plane host ", host, ": ",
                                                 error.message()));
    }
    auto socket = std::make_unique<tcp::socket>(io);
    asio::connect(*socket, addresses, error);
    if (error) {
      return absl::UnavailableError(absl::StrCat("cannot connect to the data plane of ", host, ":",
                                                 port, ": ", error.message()));
    }
    socket->set_option(tcp::no_delay(true), error);
    connection.socket = std::move(socket);
    return absl::OkStatus();
  }
};

namespace {

// Receivers never write on a data-plane connection, so anything readable on it is the end of the
// connection: the peer closed it (restarted, or was killed). Checked before each frame, so a frame is
// never written into a connection whose other end is gone (the first such write would "succeed").
bool PeerClosed(tcp::socket& socket) {
  pollfd poll_fd{socket.native_handle(), POLLIN | POLLRDHUP, 0};
  return ::poll(&poll_fd, 1, 0) != 0;
}

}  // namespace

DataPlaneClient::DataPlaneClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DataPlaneClient::~DataPlaneClient() = default;

absl::StatusOr<std::unique_ptr<DataPlaneClient>> DataPlaneClient::Connect(const std::string& host,
                                                                          uint16_t port,
                                                                          int connections) {
  if (connections < 1 || connections > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections per peer must be in [1, 64], got ", connections));
  }
  auto impl = std::make_unique<Impl>();
  impl->host = host;
  impl->port = port;
  for (int i = 0; i < connections; ++i) {
    impl->connections.push_back(std::make_unique<Impl::Connection>());
    if (absl::Status status = impl->Open(*impl->connections.back()); !status.ok()) return status;
  }
  return std::unique_ptr<DataPlaneClient>(new DataPlaneClient(std::move(impl)));
}

absl::Status DataPlaneClient::Send(FrameHeader header, absl::Span<const uint8_t> payload) {
  if (payload.size() > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("a frame payload of ", payload.size(),
                                                   " bytes does not fit the frame format"));
  }
  header.length = static_cast<uint32_t>(payload.size());
  header.payload_crc = erasure::Crc32c(payload.data(), payload.size());
  uint8_t header_bytes[FrameHeader::kBytes];
  EncodeFrameHeader(header, header_bytes);

  Impl::Connection& connection =
      *impl_->connections[impl_->next++ % impl_->connections.size()];
  std::lock_guard<std::mutex> lock(connection.mutex);
  if (connection.socket != nullptr && PeerClosed(*connection.socket)) {
    connection.socket.reset();  // the receiver restarted or went away since this was opened
  }
  if (connection.socket == nullptr) {
    if (absl::Status status = impl_->Open(connection); !status.ok()) return status;
  }
  const std::array<asio::const_buffer, 3> frame = {asio::buffer(header_bytes),
                                                   asio::buffer(header.region),
                                                   asio::buffer(payload.data(), payload.size())};
  boost::system::error_code error;
  asio::write(*connection.socket, frame, error);
  if (error) {
    connection.socket.reset();
    return absl::UnavailableError(absl::StrCat("data plane write to ", impl_->host, ":",
                                               impl_->port, " failed: ", error.message()));
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon
