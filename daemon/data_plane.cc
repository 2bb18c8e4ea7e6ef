// DataPlaneServer and DataPlaneClient over Boost.Asio: one thread per connection keeps the receive
// path a straight loop (the connection count is peers x a few). Sockets are non-blocking and every
// wait is a poll with a deadline; TLS (OpenSSL, its records through a BIO of this file) runs over
// the same deadline-bound socket.
#include "daemon/data_plane.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509_vfy.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <cerrno>
#include <cstring>
#include <list>
#include <optional>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/whole_transfer.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {

namespace asio = boost::asio;
namespace ssl = asio::ssl;
using asio::ip::tcp;

namespace {

// How long the accept loop waits before it accepts again after a failure (no descriptors, no
// threads): the failure is logged once per episode, and the loop never spins.
constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);
// How often the accept loop wakes without a connection, to reap finished ones.
constexpr int kAcceptWakeMs = 1000;
// A sender's connection (TCP, and TLS with the server's acceptance) must be made within this time.
constexpr absl::Duration kConnectTimeout = absl::Seconds(10);
// A payload checked on arrival is read and checksummed this much at a time (well within L2).
constexpr size_t kCheckedSliceBytes = 256 << 10;

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

// A non-blocking TCP socket whose reads and writes wait (poll) until a deadline, then fail with
// timed_out: the transport of a TLS session too (TlsSession), so that a handshake and every record
// are bounded in time as plaintext reads and writes are. It gathers a TLS write's records into
// fewer sends, and a receiver's records into fewer receives.
class DeadlineSocket {
 public:
  explicit DeadlineSocket(tcp::socket& socket) : socket_(socket) {}
  tcp::socket& socket() { return socket_; }
  void set_deadline(absl::Time deadline) { deadline_ = deadline; }

  template <typename Buffers>
  size_t read_some(const Buffers& buffers, boost::system::error_code& error) {
    // What was gathered goes first: the peer may be waiting for it before it answers.
    if (!gathered_.empty()) {
      SendGathered(error);
      if (error) return 0;
    }
    if (!reading_ahead_) {
      return Transfer(POLLIN, error, [&] { return socket_.read_some(buffers, error); });
    }
    error = {};
    if (asio::buffer_size(buffers) == 0) return 0;
    if (ahead_begin_ == ahead_end_) {
      if (ahead_ == nullptr) ahead_ = std::make_unique_for_overwrite<uint8_t[]>(kReadAheadBytes);
      ahead_begin_ = 0;
      ahead_end_ = Transfer(POLLIN, error, [&] {
        return socket_.read_some(asio::buffer(ahead_.get(), kReadAheadBytes), error);
      });
      if (error) return 0;
    }
    const size_t served = asio::buffer_copy(
        buffers, asio::buffer(ahead_.get() + ahead_begin_, ahead_end_ - ahead_begin_));
    ahead_begin_ += served;
    return served;
  }
  template <typename Buffers>
  size_t write_some(const Buffers& buffers, boost::system::error_code& error) {
    if (!gathering_) {
      return Transfer(POLLOUT, error, [&] { return socket_.write_some(buffers, error); });
    }
    const size_t bytes = asio::buffer_size(buffers);
    const size_t at = gathered_.size();
    gathered_.resize(at + bytes);
    asio::buffer_copy(asio::buffer(gathered_.data() + at, bytes), buffers);
    error = {};
    if (gathered_.size() >= kGatheredBytes) SendGathered(error);
    return error ? 0 : bytes;
  }

  // Between Gather and Flush, writes are kept and sent kGatheredBytes at a time: OpenSSL
  // writes one record (at most 16 KiB) a call, a system call (and a wait for room) each. Flush
  // sends what is kept unless `error` is set already, and stops gathering.
  void Gather() { gathering_ = true; }
  void Flush(boost::system::error_code& error) {
    gathering_ = false;
    if (!error && !gathered_.empty()) SendGathered(error);
    gathered_.clear();
  }
  // From then on, a read takes what the socket holds, up to kReadAheadBytes, in one system call,
  // and the reads after it are served from those bytes until they are used up: OpenSSL reads
  // about one record (at most 17 KiB) a call. For a connection whose every byte is read through
  // this socket (a receiver's): a sender polls its socket for the peer's close (PeerClosed).
  void ReadAhead() { reading_ahead_ = true; }

 private:
  template <typename Operation>
  size_t Transfer(short events, boost::system::error_code& error, Operation operation) {
    while (true) {
      const size_t done = operation();
      if (error != asio::error::would_block && error != asio::error::try_again) return done;
      if (!Await(socket_, events, deadline_).ok()) {
        error = asio::error::timed_out;
        return 0;
      }
    }
  }

  // Sends every gathered byte by the deadline.
  void SendGathered(boost::system::error_code& error) {
    for (size_t sent = 0; sent < gathered_.size() && !error;) {
      sent += Transfer(POLLOUT, error, [&] {
        return socket_.write_some(asio::buffer(gathered_.data() + sent, gathered_.size() - sent),
                                  error);
      });
    }
    gathered_.clear();
  }

  static constexpr size_t kGatheredBytes = 512 << 10;
  static constexpr size_t kReadAheadBytes = 512 << 10;
  tcp::socket& socket_;
  absl::Time deadline_ = absl::InfinitePast();
  bool gathering_ = false;
  std::vector<uint8_t> gathered_;  // keeps its capacity between writes
  bool reading_ahead_ = false;
  std::unique_ptr<uint8_t[]> ahead_;  // received, read up to ahead_begin_, up to ahead_end_
  size_t ahead_begin_ = 0;
  size_t ahead_end_ = 0;
};

absl::Status FromAsio(const boost::system::error_code& error, absl::string_view what) {
  if (error == asio::error::timed_out) {
    return absl::DeadlineExceededError(absl::StrCat(what, ": the peer did not answer in time"));
  }
  if (error == asio::error::eof) {
    return absl::UnavailableError(absl::StrCat(what, ": the peer closed the connection"));
  }
  return absl::UnavailableError(absl::StrCat(what, ": ", error.message()));
}

// A TLS session over a DeadlineSocket. OpenSSL writes its records into the socket's gathered
// bytes and reads them from its read-ahead through a BIO of this class, so a record costs one copy
// each way between OpenSSL's buffers and the socket's, and no system call of its own (asio's TLS
// stream passes each record through a BIO pair and a buffer of its own, a record a call).
class TlsSession {
 public:
  enum class Side { kClient, kServer };

  // `transport` must outlive the session.
  TlsSession(SSL_CTX* context, DeadlineSocket& transport) : transport_(transport) {
    ssl_ = SSL_new(context);
    BIO* bio = ssl_ == nullptr || Method() == nullptr ? nullptr : BIO_new(Method());
    if (bio == nullptr) return;  // Handshake says so
    BIO_set_data(bio, this);
    BIO_set_init(bio, 1);
    SSL_set_bio(ssl_, bio, bio);
  }
  ~TlsSession() { SSL_free(ssl_); }
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  SSL* ssl() const { return ssl_; }
  // A read asks the transport for as much as OpenSSL's buffer takes, not a record's header and then
  // its body: for a receiver, whose every byte is read through the session.
  void ReadAhead() { SSL_set_read_ahead(ssl_, 1); }

  absl::Status Handshake(Side side) {
    if (ssl_ == nullptr || SSL_get_rbio(ssl_) == nullptr) {
      return absl::ResourceExhaustedError("TLS handshake: cannot make a TLS session");
    }
    ERR_clear_error();
    transport_error_ = {};
    const int result = side == Side::kServer ? SSL_accept(ssl_) : SSL_connect(ssl_);
    return result == 1 ? absl::OkStatus() : Failure(result, "TLS handshake");
  }
  // Reads exactly `buffer.size()` bytes.
  absl::Status Read(asio::mutable_buffer buffer) {
    auto* into = static_cast<uint8_t*>(buffer.data());
    for (size_t done = 0; done < buffer.size();) {
      ERR_clear_error();
      transport_error_ = {};
      size_t read = 0;
      const int result = SSL_read_ex(ssl_, into + done, buffer.size() - done, &read);
      if (result != 1) return Failure(result, "read");
      done += read;
    }
    return absl::OkStatus();
  }
  // Writes every byte of `buffers`.
  absl::Status Write(const std::vector<asio::const_buffer>& buffers) {
    for (const asio::const_buffer& buffer : buffers) {
      if (buffer.size() == 0) continue;
      ERR_clear_error();
      transport_error_ = {};
      size_t written = 0;
      const int result = SSL_write_ex(ssl_, buffer.data(), buffer.size(), &written);
      if (result != 1) return Failure(result, "write");
    }
    return absl::OkStatus();
  }

 private:
  static BIO_METHOD* Method() {
    static BIO_METHOD* const method = [] {
      BIO_METHOD* made =
          BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "moesnap data plane");
      if (made != nullptr) {
        BIO_meth_set_write_ex(made, &TlsSession::BioWrite);
        BIO_meth_set_read_ex(made, &TlsSession::BioRead);
        BIO_meth_set_ctrl(made, &TlsSession::BioCtrl);
      }
      return made;
    }();
    return method;
  }
  static TlsSession& Of(BIO* bio) { return *static_cast<TlsSession*>(BIO_get_data(bio)); }
  // Blocking as a blocking socket is, up to the transport's deadline: a failure (a timeout, the
  // peer's close) is kept for Failure and ends OpenSSL's call.
  static int BioWrite(BIO* bio, const char* data, size_t length, size_t* written) {
    BIO_clear_retry_flags(bio);
    TlsSession& session = Of(bio);
    *written = 0;
    while (*written < length) {
      const size_t sent = session.transport_.write_some(
          asio::buffer(data + *written, length - *written), session.transport_error_);
      if (session.transport_error_) return *written > 0 ? 1 : 0;
      *written += sent;
    }
    return 1;
  }
  static int BioRead(BIO* bio, char* data, size_t length, size_t* read) {
    BIO_clear_retry_flags(bio);
    TlsSession& session = Of(bio);
    *read = session.transport_.read_some(asio::buffer(data, length), session.transport_error_);
    return session.transport_error_ ? 0 : 1;
  }
  static long BioCtrl(BIO*, int command, long, void*) {
    // Writes outside a gathered Write go out at once, so a flush has nothing left to send.
    return command == BIO_CTRL_FLUSH ? 1 : 0;
  }

  // Why `what` failed with OpenSSL's `result`: OpenSSL's own failure (a certificate refused, a
  // bad record) if it had one, even when the alert it then sent could not be written; else the
  // transport's (a timeout, the peer gone); else the peer's close.
  absl::Status Failure(int result, absl::string_view what) {
    const int code = SSL_get_error(ssl_, result);
    if (transport_error_ && (code != SSL_ERROR_SSL || ERR_peek_error() == 0)) {
      return FromAsio(transport_error_, what);
    }
    const unsigned long error = ERR_get_error();
    ERR_clear_error();
    if (code == SSL_ERROR_ZERO_RETURN || error == 0) {
      return absl::UnavailableError(absl::StrCat(what, ": the peer closed the connection"));
    }
    char text[256];
    ERR_error_string_n(error, text, sizeof(text));
    return absl::UnavailableError(absl::StrCat(what, ": ", text));
  }

  DeadlineSocket& transport_;
  boost::system::error_code transport_error_;  // of the last BIO call, if it failed
  SSL* ssl_ = nullptr;
};

// One data-plane connection, plaintext or TLS; every read, write and handshake ends by a deadline.
class Link {
 public:
  // `tls` null: plaintext. `socket` (non-blocking) must outlive the link.
  Link(tcp::socket& socket, ssl::context* tls) : transport_(socket) {
    if (tls != nullptr) tls_.emplace(tls->native_handle(), transport_);
  }

  tcp::socket& socket() { return transport_.socket(); }
  bool encrypted() const { return tls_.has_value(); }
  // A receiver's encrypted link reads ahead of its TLS records (DeadlineSocket::ReadAhead); a
  // plaintext one reads each payload straight into its destination.
  void ReadAheadOfRecords() {
    if (!encrypted()) return;
    transport_.ReadAhead();
    tls_->ReadAhead();
  }
  SSL* ssl() { return tls_ ? tls_->ssl() : nullptr; }

  absl::Status Handshake(TlsSession::Side side, absl::Time deadline) {
    transport_.set_deadline(deadline);
    return tls_->Handshake(side);
  }
  absl::Status Read(asio::mutable_buffer buffer, absl::Time deadline) {
    transport_.set_deadline(deadline);
    if (tls_) return tls_->Read(buffer);
    boost::system::error_code error;
    asio::read(transport_, buffer, WholeTransfer(), error);
    return error ? FromAsio(error, "read") : absl::OkStatus();
  }
  absl::Status Write(const std::vector<asio::const_buffer>& buffers, absl::Time deadline) {
    transport_.set_deadline(deadline);
    absl::Status status;
    boost::system::error_code error;
    if (tls_) {
      transport_.Gather();
      status = tls_->Write(buffers);
      if (!status.ok()) error = asio::error::broken_pipe;  // so that Flush sends nothing more
      transport_.Flush(error);
      if (status.ok() && error) status = FromAsio(error, "write");
    } else {
      asio::write(transport_, buffers, WholeTransfer(), error);
      if (error) status = FromAsio(error, "write");
    }
    if (absl::IsDeadlineExceeded(status)) {
      return absl::DeadlineExceededError("the peer took nothing more in time (not reading)");
    }
    return status;
  }
  void Shutdown() {
    boost::system::error_code error;
    socket().shutdown(tcp::socket::shutdown_both, error);
  }

 private:
  DeadlineSocket transport_;
  std::optional<TlsSession> tls_;  // over transport_
};

// What the server answers on a TLS connection once it accepted the peer's certificate.
constexpr uint8_t kPeerAccepted = 0x01;

// A TLS context with this node's certificate and key, trusting the job's CA only; the server
// requires a client certificate. The server sends no session tickets: after the handshake a
// receiver writes nothing but its acceptance byte, so anything readable on a sender's connection is
// its end (PeerClosed).
absl::StatusOr<std::unique_ptr<ssl::context>> TlsContext(const PeerTls& tls, bool server) {
  auto context = std::make_unique<ssl::context>(server ? ssl::context::tls_server
                                                       : ssl::context::tls_client);
  boost::system::error_code error;
  context->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                           ssl::context::no_sslv3 | ssl::context::no_tlsv1 |
                           ssl::context::no_tlsv1_1,
                       error);
  if (!error) context->add_certificate_authority(asio::buffer(tls.ca_pem()), error);
  if (!error) context->use_certificate_chain(asio::buffer(tls.cert_pem()), error);
  if (!error) context->use_private_key(asio::buffer(tls.key_pem()), ssl::context::pem, error);
  if (!error) {
    context->set_verify_mode(
        server ? ssl::verify_peer | ssl::verify_fail_if_no_peer_cert : ssl::verify_peer, error);
  }
  if (error) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot set up the data plane's TLS: ", error.message()));
  }
  if (server) SSL_CTX_set_num_tickets(context->native_handle(), 0);
  return context;
}

// Why a server-side handshake failed, for the refusal count.
PeerRefusal HandshakeRefusal(Link& link, const absl::Status& status, std::string* reason) {
  const long verified = link.ssl() == nullptr ? X509_V_OK : SSL_get_verify_result(link.ssl());
  if (verified != X509_V_OK) {
    *reason = absl::StrCat("its certificate does not check against the job's CA: ",
                           X509_verify_cert_error_string(verified));
    return PeerRefusal::kUntrustedCertificate;
  }
  *reason = std::string(status.message());
  if (absl::StrContains(*reason, "did not return a certificate") ||
      absl::StrContains(*reason, "certificate required")) {
    return PeerRefusal::kNoCertificate;
  }
  return PeerRefusal::kHandshake;
}

}  // namespace

struct DataPlaneServer::Impl {
  DataPlaneOptions options;
  std::unique_ptr<ssl::context> tls_context;  // null: plaintext
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
        Log(LogLevel::kWarning, "data plane: refusing a connection from ",
            PeerName(*socket).first, ": ", refused);
        ++owner->connections_rejected_;
        socket->close(error);
      }
    }
  }

  // The peer's address and port, and its address alone ("a peer" and "" when the socket has none).
  static std::pair<std::string, std::string> PeerName(tcp::socket& socket) {
    boost::system::error_code error;
    const tcp::endpoint remote = socket.remote_endpoint(error);
    if (error) return {"a peer", ""};
    const std::string address = remote.address().to_string();
    return {absl::StrCat(address, ":", remote.port()), address};
  }

  // Refuses a peer: counted in connections_rejected and as a peer refusal.
  void Refuse(PeerRefusal refusal, const std::string& message) {
    ++owner->connections_rejected_;
    RecordPeerRefusal(PeerPlane::kData, refusal, message);
  }

  // With TLS: the handshake, the peer's certificate naming this job and one of its nodes, then the
  // acceptance byte. The node the certificate names; nullopt when the peer was refused (and
  // counted).
  std::optional<uint32_t> Admit(Link& link, const std::string& peer) {
    const absl::Time deadline = absl::Now() + options.handshake_timeout;
    if (absl::Status shaken = link.Handshake(TlsSession::Side::kServer, deadline); !shaken.ok()) {
      std::string reason;
      const PeerRefusal refusal = HandshakeRefusal(link, shaken, &reason);
      Refuse(refusal, absl::StrCat(peer, ": ", reason));
      return std::nullopt;
    }
    PeerRefusal refusal = PeerRefusal::kHandshake;
    absl::StatusOr<PeerIdentity> identity =
        options.tls->CheckName(SSL_get0_peer_certificate(link.ssl()), &refusal);
    if (!identity.ok()) {
      Refuse(refusal, absl::StrCat(peer, ": ", identity.status().message()));
      return std::nullopt;
    }
    const uint8_t accepted = kPeerAccepted;
    if (!link.Write({asio::buffer(&accepted, 1)}, deadline).ok()) return std::nullopt;
    Log(LogLevel::kDebug, "data plane: ", peer, " is ", PeerUri(*identity));
    return identity->node_id;
  }

  // Reads `into` from `link` by `deadline`; with `crc`, computes the bytes' CRC-32C into it a slice
  // at a time as each lands, while the slice is still in cache, instead of in a second pass over
  // the whole payload from memory.
  static absl::Status ReadPayload(Link& link, absl::Span<uint8_t> into, absl::Time deadline,
                                  uint32_t* crc) {
    if (crc == nullptr) return link.Read(asio::buffer(into.data(), into.size()), deadline);
    for (size_t offset = 0; offset < into.size(); offset += kCheckedSliceBytes) {
      const size_t bytes = std::min(kCheckedSliceBytes, into.size() - offset);
      if (absl::Status status = link.Read(asio::buffer(into.data() + offset, bytes), deadline);
          !status.ok()) {
        return status;
      }
      *crc = erasure::Crc32cExtend(*crc, into.data() + offset, bytes);
    }
    return absl::OkStatus();
  }

  // Reads frames until the peer closes, sends something malformed or stalls.
  void Serve(tcp::socket& socket) {
    std::vector<uint8_t> payload;
    uint8_t header_bytes[FrameHeader::kBytes];
    const auto [peer, peer_address] = PeerName(socket);
    Link link(socket, tls_context.get());
    std::optional<uint32_t> sender;  // known only when the connection is authenticated
    if (link.encrypted()) {
      sender = Admit(link, peer);
      if (!sender) {
        link.Shutdown();
        return;
      }
    }
    link.ReadAheadOfRecords();  // its buffer only for a peer admitted
    while (!stopping) {
      // Between frames a connection may idle; once a frame begins (its first byte), all of it must
      // arrive in time. The first byte is read, not polled for: TLS may hold it decrypted already.
      absl::Status status = link.Read(asio::buffer(header_bytes, 1),
                                      absl::Now() + options.idle_timeout);
      if (absl::IsDeadlineExceeded(status)) {
        Log(LogLevel::kDebug, "data plane: closing the idle connection from ", peer);
        break;
      }
      if (!status.ok()) break;  // closed between frames
      const absl::Time frame_deadline = absl::Now() + options.frame_timeout;
      status = link.Read(asio::buffer(header_bytes + 1, FrameHeader::kBytes - 1), frame_deadline);
      absl::StatusOr<FrameHeader> header =
          status.ok() ? DecodeFrameHeader(header_bytes, options.max_payload_bytes)
                      : absl::StatusOr<FrameHeader>(status);
      status = header.status();
      if (status.ok()) status = link.Read(asio::buffer(header->region), frame_deadline);
      std::optional<FrameSink::InPlace> in_place;  // the sink's memory the payload is read into
      if (status.ok()) {
        absl::StatusOr<std::optional<FrameSink::InPlace>> reserved =
            sink->Reserve(*header, sender);
        if (!reserved.ok()) {
          status = reserved.status();
        } else if (*reserved && !(*reserved)->drop &&
                   (*reserved)->bytes.size() != header->length) {
          status = absl::InternalError(absl::StrCat("the sink reserved ",
                                                    (*reserved)->bytes.size(),
                                                    " bytes for a payload of ", header->length));
          sink->Filled(*header, status);
        } else {
          in_place = *reserved;
        }
      }
      absl::Span<uint8_t> into;
      // The payload is checked here unless the sink checks it as it uses it, or drops it.
      const bool check_here = !(in_place && (in_place->owner_checks || in_place->drop));
      uint32_t crc = 0;
      if (status.ok()) {
        if (in_place && !in_place->drop) {
          into = in_place->bytes;
        } else {
          payload.resize(header->length);
          into = absl::MakeSpan(payload);
        }
        status = ReadPayload(link, into, frame_deadline, check_here ? &crc : nullptr);
      }
      if (!status.ok() && (absl::IsDeadlineExceeded(status) || absl::IsUnavailable(status))) {
        status = absl::DataLossError(absl::StrCat("a frame did not arrive whole within ",
                                                  absl::FormatDuration(options.frame_timeout),
                                                  ": ", status.message()));
      }
      if (status.ok() && check_here) status = CheckFramePayloadCrc(*header, into.size(), crc);
      // A frame that fails in place fails its fetch (Filled), whose owner may at once begin
      // another: the sink hears of the closed connection first, so that only the fetches that
      // awaited the frames lost with it fail.
      if (!status.ok()) sink->ConnectionClosed(sender, peer_address, status);
      if (in_place) {
        if (!in_place->drop) sink->Filled(*header, status);
      } else if (status.ok()) {
        status = sink->Accept(*header, payload, sender);
        if (!status.ok()) sink->ConnectionClosed(sender, peer_address, status);
      }
      if (!status.ok()) {
        Log(LogLevel::kWarning, "data plane: closing the connection from ", peer, ": ",
            status.ToString());
        ++owner->connections_rejected_;
        break;
      }
      ++owner->frames_accepted_;
    }
    link.Shutdown();
  }
};

DataPlaneServer::DataPlaneServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<DataPlaneServer>> DataPlaneServer::Start(
    const DataPlaneOptions& options, FrameSink* sink) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->sink = sink;
  if (options.tls != nullptr) {
    absl::StatusOr<std::unique_ptr<ssl::context>> context = TlsContext(*options.tls, true);
    if (!context.ok()) return context.status();
    impl->tls_context = *std::move(context);
  }
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

namespace {

// Receivers write nothing on a data-plane connection after accepting it, so anything readable on
// it is its end: the peer closed it (restarted, was killed, or refused a frame). Checked before
// each frame, so a frame is never written into a connection whose other end is gone (the first
// such write would "succeed").
bool PeerClosed(tcp::socket& socket) {
  pollfd poll_fd{socket.native_handle(), POLLIN | POLLRDHUP, 0};
  return ::poll(&poll_fd, 1, 0) != 0;
}

// Connects a non-blocking `socket` to `endpoint` by `deadline` (the kernel's own SYN timeout is
// minutes).
boost::system::error_code ConnectBy(tcp::socket& socket, const tcp::endpoint& endpoint,
                                    absl::Time deadline) {
  boost::system::error_code error;
  if (socket.is_open()) socket.close(error);
  socket.open(endpoint.protocol(), error);
  if (!error) socket.non_blocking(true, error);
  if (!error) socket.connect(endpoint, error);
  if (error == asio::error::in_progress || error == asio::error::would_block) {
    if (!Await(socket, POLLOUT, deadline).ok()) {
      socket.close(error);
      return asio::error::timed_out;
    }
    int failure = 0;
    socklen_t length = sizeof(failure);
    if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_ERROR, &failure, &length) != 0) {
      failure = errno;
    }
    error = boost::system::error_code(failure, boost::system::system_category());
  }
  if (error) {
    boost::system::error_code ignored;
    socket.close(ignored);
  }
  return error;
}

}  // namespace

struct DataPlaneClient::Impl {
  std::string host;
  uint16_t port = 0;
  absl::Duration send_timeout;
  DataPlaneClientTls tls;
  std::unique_ptr<ssl::context> tls_context;  // null: plaintext
  asio::io_context io;
  struct Connection {
    std::mutex mutex;
    std::unique_ptr<tcp::socket> socket;  // null until connected, or after a failure
    std::unique_ptr<Link> link;           // over socket
    void Reset() {
      link.reset();
      socket.reset();
    }
  };
  std::vector<std::unique_ptr<Connection>> connections;
  std::atomic<uint64_t> next{0};

  std::string Where() const { return absl::StrCat(host, ":", port); }

  // `host` is an IP address or a host name (a replacement node may advertise either); each of its
  // addresses is tried in turn, all within the connect timeout.
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
    const absl::Time deadline = absl::Now() + kConnectTimeout;
    error = asio::error::host_not_found;
    for (const auto& address : addresses) {
      error = ConnectBy(*socket, address.endpoint(), deadline);
      if (!error) break;
    }
    if (error) {
      const std::string within =
          error == asio::error::timed_out
              ? absl::StrCat(" within ", absl::FormatDuration(kConnectTimeout))
              : "";
      return absl::UnavailableError(absl::StrCat("cannot connect to the data plane of ", Where(),
                                                 within, ": ", error.message()));
    }
    socket->set_option(tcp::no_delay(true), error);
    auto link = std::make_unique<Link>(*socket, tls_context.get());
    if (link->encrypted()) {
      if (absl::Status admitted = Authenticate(*link, deadline); !admitted.ok()) return admitted;
    }
    connection.socket = std::move(socket);
    connection.link = std::move(link);
    return absl::OkStatus();
  }

  // The handshake, the server's certificate naming the node meant, and the server's acceptance.
  absl::Status Authenticate(Link& link, absl::Time deadline) {
    const PeerIdentity expected{tls.tls->self().job, tls.peer_node};
    const std::string server = absl::StrCat("data plane of ", Where(), " (", PeerUri(expected), ")");
    if (absl::Status shaken = link.Handshake(TlsSession::Side::kClient, deadline); !shaken.ok()) {
      return absl::UnavailableError(absl::StrCat(server, ": ", shaken.message()));
    }
    PeerRefusal refusal = PeerRefusal::kHandshake;
    absl::StatusOr<PeerIdentity> identity =
        tls.tls->CheckName(SSL_get0_peer_certificate(link.ssl()), &refusal);
    if (identity.ok() && *identity != expected) {
      refusal = PeerRefusal::kOtherNode;
      identity = absl::UnauthenticatedError(absl::StrCat(
          "the server's certificate names ", PeerUri(*identity), ", not the node meant"));
    }
    if (!identity.ok()) {
      const std::string message = absl::StrCat(server, ": ", identity.status().message());
      RecordPeerRefusal(PeerPlane::kData, refusal, message);
      return absl::UnauthenticatedError(message);
    }
    uint8_t accepted = 0;
    if (absl::Status read = link.Read(asio::buffer(&accepted, 1), deadline);
        !read.ok() || accepted != kPeerAccepted) {
      return absl::UnauthenticatedError(absl::StrCat(
          server, " refused this node's certificate (", PeerUri(tls.tls->self()),
          "; its log says why): ", read.ok() ? "unexpected answer" : read.message()));
    }
    return absl::OkStatus();
  }
};

DataPlaneClient::DataPlaneClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DataPlaneClient::~DataPlaneClient() = default;

absl::StatusOr<std::unique_ptr<DataPlaneClient>> DataPlaneClient::Connect(
    const std::string& host, uint16_t port, int connections, absl::Duration send_timeout,
    DataPlaneClientTls tls) {
  if (connections < 1 || connections > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections per peer must be in [1, 64], got ", connections));
  }
  auto impl = std::make_unique<Impl>();
  impl->host = host;
  impl->port = port;
  impl->send_timeout = send_timeout;
  impl->tls = std::move(tls);
  if (impl->tls.tls != nullptr) {
    absl::StatusOr<std::unique_ptr<ssl::context>> context = TlsContext(*impl->tls.tls, false);
    if (!context.ok()) return context.status();
    impl->tls_context = *std::move(context);
  }
  for (int i = 0; i < connections; ++i) {
    impl->connections.push_back(std::make_unique<Impl::Connection>());
    if (absl::Status status = impl->Open(*impl->connections.back()); !status.ok()) return status;
  }
  return std::unique_ptr<DataPlaneClient>(new DataPlaneClient(std::move(impl)));
}

absl::Status DataPlaneClient::Send(FrameHeader header,
                                   absl::Span<const absl::Span<const uint8_t>> pieces) {
  if (absl::Status sealed = SealFrame(header, pieces); !sealed.ok()) return sealed;
  return SendSealed(header, pieces);
}

absl::Status DataPlaneClient::SendSealed(const FrameHeader& header,
                                         absl::Span<const absl::Span<const uint8_t>> pieces) {
  uint8_t header_bytes[FrameHeader::kBytes];
  EncodeFrameHeader(header, header_bytes);
  std::vector<asio::const_buffer> buffers = {asio::buffer(header_bytes),
                                             asio::buffer(header.region)};
  for (absl::Span<const uint8_t> piece : pieces) {
    buffers.push_back(asio::buffer(piece.data(), piece.size()));
  }

  Impl::Connection& connection =
      *impl_->connections[impl_->next++ % impl_->connections.size()];
  std::lock_guard<std::mutex> lock(connection.mutex);
  if (connection.socket != nullptr && PeerClosed(*connection.socket)) {
    connection.Reset();  // the receiver restarted or went away since this was opened
  }
  if (connection.socket == nullptr) {
    if (absl::Status status = impl_->Open(connection); !status.ok()) return status;
  }
  const absl::Status written = connection.link->Write(buffers, absl::Now() + impl_->send_timeout);
  if (!written.ok()) {
    // A frame cut short leaves the stream unusable: the next send starts a new connection.
    connection.Reset();
    return absl::UnavailableError(absl::StrCat("data plane write to ", impl_->host, ":",
                                               impl_->port, " failed: ", written.message()));
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon
