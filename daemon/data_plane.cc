// DataPlaneServer and DataPlaneClient over Boost.Asio with blocking sockets: one thread per
// connection keeps the receive path a straight loop (the connection count is peers x a few).
#include "daemon/data_plane.h"

#include <boost/asio.hpp>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

// How long the accept loop waits before it accepts again after a failure (no descriptors, no
// threads): the failure is logged once per episode, and the loop never spins.
constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);
// How often the accept loop wakes without a connection, to reap finished ones.
constexpr int kAcceptWakeMs = 1000;

int PollMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 60000));
}

// Waits until `socket` is readable (`events` POLLIN) or writable (POLLOUT), by `deadline`.
absl::Status Await(tcp::socket& socket, short events, absl::Time deadline) {
  while (true) {
    pollfd poll_fd{socket.native_handle(), events, 0};
    const int ready = ::poll(&poll_fd, 1, PollMs(deadline));
    if (ready > 0) return absl::OkStatus();
    if (ready < 0 && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("poll failed: ", std::strerror(errno)));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("the peer sent nothing in time");
    }
  }
}

// Reads exactly `buffer`'s bytes from a non-blocking socket by `deadline`.
absl::Status ReadExactly(tcp::socket& socket, asio::mutable_buffer buffer, absl::Time deadline) {
  while (buffer.size() > 0) {
    boost::system::error_code error;
    const size_t read = socket.read_some(buffer, error);
    buffer += read;
    if (error == asio::error::would_block || error == asio::error::try_again) {
      if (absl::Status status = Await(socket, POLLIN, deadline); !status.ok()) return status;
    } else if (error) {
      return absl::UnavailableError(error.message());
    }
  }
  return absl::OkStatus();
}

}  // namespace

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

  // Joins the threads of connections that ended; how many are still served.
  size_t ReapLocked() {
    for (auto it = connections.begin(); it != connections.end();) {
      if (*it->finished) {
        it->thread.join();
        it = connections.erase(it);
      } else {
        ++it;
      }
    }
    return connections.size();
  }

  void AcceptLoop() {
    bool failing = false;  // in an episode of accept failures, logged once
    while (!stopping) {
      pollfd poll_fd{acceptor.native_handle(), POLLIN, 0};
      const int ready = ::poll(&poll_fd, 1, kAcceptWakeMs);
      if (stopping) break;
      if (ready < 0 && errno != EINTR) {
        Log(LogLevel::kWarning, "data plane: waiting for connections failed: ",
            std::strerror(errno));
        std::this_thread::sleep_for(absl::ToChronoMilliseconds(kAcceptBackoff));
      }
      if (ready <= 0) {
        std::lock_guard<std::mutex> lock(mutex);
        ReapLocked();
        continue;
      }
      auto socket = std::make_shared<tcp::socket>(io);
      boost::system::error_code error;
      acceptor.accept(*socket, error);
      if (stopping) break;
      if (error) {
        // Out of descriptors, memory or buffers: connections already open go on; this one waits
        // in the backlog until the backoff ends.
        if (!failing) {
          Log(LogLevel::kWarning, "data plane: accepting a connection failed (", error.message(),
              "); retrying every ", absl::FormatDuration(kAcceptBackoff));
        }
        failing = true;
        ++owner->connections_rejected_;
        std::this_thread::sleep_for(absl::ToChronoMilliseconds(kAcceptBackoff));
        continue;
      }
      failing = false;
      socket->set_option(tcp::no_delay(true), error);
      socket->non_blocking(true, error);
      std::lock_guard<std::mutex> lock(mutex);
      std::string refused;
      if (ReapLocked() >= options.max_connections) {
        refused = absl::StrCat(options.max_connections, " connections are open (the limit)");
      } else {
        auto finished = std::make_shared<std::atomic<bool>>(false);
        try {
          connections.push_back({socket, finished, std::thread([this, socket, finished] {
                                   Serve(*socket);
                                   *finished = true;
                                 })});
        } catch (const std::system_error& failure) {
          refused = absl::StrCat("no thread for it: ", failure.what());
        }
      }
      if (!refused.empty()) {
        Log(LogLevel::kWarning, "data plane: refusing a connection from ", PeerName(*socket), ": ",
            refused);
        ++owner->connections_rejected_;
        socket->close(error);
      }
    }
  }

  static std::string PeerName(tcp::socket& socket) {
    boost::system::error_code error;
    const tcp::endpoint remote = socket.remote_endpoint(error);
    if (error) return "a peer";
    return absl::StrCat(remote.address().to_string(), ":", remote.port());
  }

  // Reads frames until the peer closes, sends something malformed or stalls.
  void Serve(tcp::socket& socket) {
    std::vector<uint8_t> payload;
    uint8_t header_bytes[FrameHeader::kBytes];
    const std::string peer = PeerName(socket);
    while (!stopping) {
      // Between frames a connection may idle; once a frame begins, all of it must arrive in time.
      absl::Status status = Await(socket, POLLIN, absl::Now() + options.idle_timeout);
      if (absl::IsDeadlineExceeded(status)) {
        Log(LogLevel::kDebug, "data plane: closing the idle connection from ", peer);
        break;
      }
      const absl::Time frame_deadline = absl::Now() + options.frame_timeout;
      if (status.ok()) status = ReadExactly(socket, asio::buffer(header_bytes), frame_deadline);
      if (!status.ok() && !absl::IsDeadlineExceeded(status)) break;  // closed between frames
      absl::StatusOr<FrameHeader> header =
          status.ok() ? DecodeFrameHeader(header_bytes, options.max_payload_bytes)
                      : absl::StatusOr<FrameHeader>(status);
      status = header.status();
      if (status.ok()) {
        payload.resize(header->length);
        status = ReadExactly(socket, asio::buffer(header->region), frame_deadline);
        if (status.ok()) status = ReadExactly(socket, asio::buffer(payload), frame_deadline);
        if (!status.ok()) {
          status = absl::DataLossError(absl::StrCat("a frame of ", header->length,
                                                    " bytes did not arrive whole within ",
                                                    absl::FormatDuration(options.frame_timeout),
                                                    ": ", status.message()));
        }
      }
      if (status.ok()) status = CheckFramePayload(*header, payload);
      if (status.ok()) status = sink->Accept(*header, payload);
      if (!status.ok()) {
        Log(LogLevel::kWarning, "data plane: closing the connection from ", peer, ": ",
            status.ToString());
        ++owner->connections_rejected_;
        break;
      }
      ++owner->frames_accepted_;
    }
    boost::system::error_code error;
    socket.shutdown(tcp::socket::shutdown_both, error);
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

uint64_t DataPlaneServer::connections_open() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  uint64_t open = 0;
  for (const Impl::Connection& connection : impl_->connections) open += !*connection.finished;
  return open;
}

DataPlaneServer::~DataPlaneServer() {
  impl_->stopping = true;
  boost::system::error_code error;
  // The accept loop's poll is woken by shutting the listening socket down.
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
  absl::Duration send_timeout;
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
    socket->non_blocking(true, error);
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

// Writes every byte of `buffers` to a non-blocking socket by `deadline`.
absl::Status WriteAll(tcp::socket& socket, std::vector<asio::const_buffer> buffers,
                      absl::Time deadline) {
  size_t first = 0;  // the first buffer with bytes left
  while (true) {
    while (first < buffers.size() && buffers[first].size() == 0) ++first;
    if (first == buffers.size()) return absl::OkStatus();
    boost::system::error_code error;
    size_t written = socket.write_some(
        std::vector<asio::const_buffer>(buffers.begin() + first, buffers.end()), error);
    for (size_t i = first; written > 0; ++i) {
      const size_t taken = std::min(written, buffers[i].size());
      buffers[i] += taken;
      written -= taken;
    }
    if (error == asio::error::would_block || error == asio::error::try_again) {
      if (absl::Status status = Await(socket, POLLOUT, deadline); !status.ok()) {
        return absl::DeadlineExceededError("the peer took nothing more in time (not reading)");
      }
    } else if (error) {
      return absl::UnavailableError(error.message());
    }
  }
}

}  // namespace

DataPlaneClient::DataPlaneClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DataPlaneClient::~DataPlaneClient() = default;

absl::StatusOr<std::unique_ptr<DataPlaneClient>> DataPlaneClient::Connect(const std::string& host,
                                                                          uint16_t port,
                                                                          int connections,
                                                                          absl::Duration send_timeout) {
  if (connections < 1 || connections > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections per peer must be in [1, 64], got ", connections));
  }
  auto impl = std::make_unique<Impl>();
  impl->host = host;
  impl->port = port;
  impl->send_timeout = send_timeout;
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
  const absl::Status written = WriteAll(
      *connection.socket,
      {asio::buffer(header_bytes), asio::buffer(header.region),
       asio::buffer(payload.data(), payload.size())},
      absl::Now() + impl_->send_timeout);
  if (!written.ok()) {
    // A frame cut short leaves the stream unusable: the next send starts a new connection.
    connection.socket.reset();
    return absl::UnavailableError(absl::StrCat("data plane write to ", impl_->host, ":",
                                               impl_->port, " failed: ", written.message()));
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon
