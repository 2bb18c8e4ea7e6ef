// The data plane over real loopback sockets: frames arrive whole and in order per connection from
// concurrent senders; malformed, corrupt and truncated frames close the connection and never reach
// the sink; the server keeps serving other connections.
#include "daemon/data_plane.h"

#include <gtest/gtest.h>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>

#include <poll.h>
#include <sys/resource.h>

#include <array>
#include <map>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "erasure/crc32c.h"
#include "tests/testing/deterministic_bytes.h"
#include "tests/testing/job_certificates.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

class CollectingSink : public FrameSink {
 public:
  absl::Status Accept(const FrameHeader& header, absl::Span<const uint8_t> payload,
                      std::optional<uint32_t> sender) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (refuse_) return absl::FailedPreconditionError("refusing on purpose");
    frames_[{header.rank, header.stripe}] = {header.region,
                                             std::vector<uint8_t>(payload.begin(), payload.end())};
    senders_.insert(sender);
    return absl::OkStatus();
  }
  void ConnectionClosed(std::optional<uint32_t> sender, const std::string& address,
                        const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_.push_back({sender, address, why});
  }
  struct Closed {
    std::optional<uint32_t> sender;
    std::string address;
    absl::Status why;
  };
  // The connections the server closed, as it told the sink.
  std::vector<Closed> closed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return closed_;
  }
  // The senders the frames were accepted from (nullopt: a plaintext connection).
  std::set<std::optional<uint32_t>> senders() {
    std::lock_guard<std::mutex> lock(mutex_);
    return senders_;
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return frames_.size();
  }
  std::pair<std::string, std::vector<uint8_t>> Get(uint32_t rank, uint64_t stripe) {
    std::lock_guard<std::mutex> lock(mutex_);
    return frames_.at({rank, stripe});
  }
  void set_refuse(bool refuse) {
    std::lock_guard<std::mutex> lock(mutex_);
    refuse_ = refuse;
  }

 private:
  std::mutex mutex_;
  bool refuse_ = false;
  std::map<std::pair<uint32_t, uint64_t>, std::pair<std::string, std::vector<uint8_t>>> frames_;
  std::set<std::optional<uint32_t>> senders_;
  std::vector<Closed> closed_;
};

std::vector<uint8_t> PayloadFor(uint32_t rank, uint64_t stripe) {
  return testing::DeterministicBytes(rank * 1000 + stripe).Bytes(1000 + stripe * 977 % 70000);
}

FrameHeader HeaderFor(uint32_t rank, uint64_t stripe) {
  FrameHeader header;
  header.kind = FrameKind::kFetchedUnit;
  header.step = 5;
  header.rank = rank;
  header.stripe = stripe;
  header.region = "layer" + std::to_string(stripe % 7) + ".expert" + std::to_string(rank);
  return header;
}

// Waits until `condition` holds or two seconds pass.
template <typename Condition>
bool Eventually(Condition condition) {
  for (int i = 0; i < 400; ++i) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return condition();
}

class DataPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DataPlaneServer>> server =
        DataPlaneServer::Start({.host = "127.0.0.1", .port = 0, .max_payload_bytes = 1 << 20},
                               &sink_);
    ASSERT_OK(server);
    server_ = *std::move(server);
  }

  // A raw socket to the server, for writing what no DataPlaneClient would.
  tcp::socket Raw() {
    tcp::socket socket(io_);
    socket.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), server_->port()));
    return socket;
  }

  // True when the server has closed `socket` (a read returns end of file or a reset).
  static bool Closed(tcp::socket& socket) {
    uint8_t byte;
    boost::system::error_code error;
    socket.read_some(asio::buffer(&byte, 1), error);
    return error == asio::error::eof || error == asio::error::connection_reset;
  }

  CollectingSink sink_;
  std::unique_ptr<DataPlaneServer> server_;
  asio::io_context io_;
};

TEST_F(DataPlaneTest, ConcurrentSendersDeliverEveryFrameIntact) {
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client =
      DataPlaneClient::Connect("127.0.0.1", server_->port(), 3);
  ASSERT_OK(client);
  std::vector<std::thread> senders;
  std::atomic<int> failures{0};
  for (uint32_t rank = 0; rank < 4; ++rank) {
    senders.emplace_back([&, rank] {
      for (uint64_t stripe = 0; stripe < 50; ++stripe) {
        if (!(*client)->Send(HeaderFor(rank, stripe), PayloadFor(rank, stripe)).ok()) ++failures;
      }
    });
  }
  for (std::thread& sender : senders) sender.join();
  EXPECT_EQ(failures, 0);
  ASSERT_TRUE(Eventually([&] { return sink_.size() == 200; }));
  for (uint32_t rank = 0; rank < 4; ++rank) {
    for (uint64_t stripe = 0; stripe < 50; ++stripe) {
      const auto [region, payload] = sink_.Get(rank, stripe);
      EXPECT_EQ(region, HeaderFor(rank, stripe).region);
      ASSERT_EQ(payload, PayloadFor(rank, stripe)) << rank << "/" << stripe;
    }
  }
  // A plaintext connection names no sender.
  EXPECT_EQ(sink_.senders(), std::set<std::optional<uint32_t>>{std::nullopt});
  EXPECT_EQ(server_->connections_rejected(), 0u);
}

TEST_F(DataPlaneTest, AFrameGatheredFromPiecesArrivesAsTheirConcatenation) {
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client =
      DataPlaneClient::Connect("127.0.0.1", server_->port(), 1);
  ASSERT_OK(client);
  const std::vector<uint8_t> payload = PayloadFor(5, 9);
  ASSERT_GT(payload.size(), 100u);
  const absl::Span<const uint8_t> whole(payload);
  // The server checks the payload's CRC-32C: it must be that of the concatenation.
  const std::vector<absl::Span<const uint8_t>> pieces = {
      whole.subspan(0, 1), whole.subspan(1, 0), whole.subspan(1, 98), whole.subspan(99)};
  ASSERT_OK((*client)->Send(HeaderFor(5, 9), pieces));
  ASSERT_TRUE(Eventually([&] { return sink_.size() == 1; }));
  EXPECT_EQ(sink_.Get(5, 9).second, payload);
}

// Frames however they are cut on the wire arrive whole: many small ones in one write (headers,
// names and payloads of 0 to 9 KiB back to back) and one written a byte at a time.
TEST_F(DataPlaneTest, SmallFramesBackToBackAndAFrameByteByByteArriveWhole) {
  std::vector<uint8_t> wire;
  auto append = [&](uint32_t rank, uint64_t stripe, size_t bytes) {
    const std::vector<uint8_t> payload = PayloadFor(rank, stripe);
    FrameHeader header = HeaderFor(rank, stripe);
    if (stripe % 5 == 0) header.region.clear();
    const absl::Span<const uint8_t> piece(payload.data(), bytes);
    EXPECT_OK(SealFrame(header, {&piece, 1}));
    uint8_t encoded[FrameHeader::kBytes];
    EncodeFrameHeader(header, encoded);
    wire.insert(wire.end(), encoded, encoded + FrameHeader::kBytes);
    wire.insert(wire.end(), header.region.begin(), header.region.end());
    wire.insert(wire.end(), piece.begin(), piece.end());
  };
  auto expect = [&](uint32_t rank, uint64_t stripe, size_t bytes) {
    const auto [region, payload] = sink_.Get(rank, stripe);
    EXPECT_EQ(region, stripe % 5 == 0 ? "" : HeaderFor(rank, stripe).region);
    const std::vector<uint8_t> sent = PayloadFor(rank, stripe);
    EXPECT_EQ(payload, std::vector<uint8_t>(sent.begin(), sent.begin() + bytes))
        << rank << "/" << stripe;
  };
  constexpr uint64_t kFrames = 60;
  auto bytes_of = [](uint64_t stripe) -> size_t { return stripe * 157 % 9000; };
  for (uint64_t stripe = 0; stripe < kFrames; ++stripe) append(1, stripe, bytes_of(stripe));
  tcp::socket together = Raw();
  asio::write(together, asio::buffer(wire));
  ASSERT_TRUE(Eventually([&] { return sink_.size() == kFrames; }));
  for (uint64_t stripe = 0; stripe < kFrames; ++stripe) expect(1, stripe, bytes_of(stripe));

  wire.clear();
  append(2, 7, 5000);
  tcp::socket dribbling = Raw();
  dribbling.set_option(tcp::no_delay(true));
  for (const uint8_t byte : wire) asio::write(dribbling, asio::buffer(&byte, 1));
  ASSERT_TRUE(Eventually([&] { return sink_.size() == kFrames + 1; }));
  expect(2, 7, 5000);
  EXPECT_EQ(server_->connections_rejected(), 0u);
}

TEST_F(DataPlaneTest, MalformedCorruptAndTruncatedFramesAreRefused) {
  const std::vector<uint8_t> payload = PayloadFor(1, 1);
  FrameHeader header = HeaderFor(1, 1);
  header.length = static_cast<uint32_t>(payload.size());
  header.payload_crc = erasure::Crc32c(payload.data(), payload.size());
  uint8_t good[FrameHeader::kBytes];
  EncodeFrameHeader(header, good);

  {  // Bad magic.
    tcp::socket socket = Raw();
    std::vector<uint8_t> bad(good, good + FrameHeader::kBytes);
    bad[0] = 'X';
    asio::write(socket, asio::buffer(bad));
    EXPECT_TRUE(Closed(socket));
  }
  {  // Good header, corrupt payload.
    tcp::socket socket = Raw();
    std::vector<uint8_t> damaged = payload;
    damaged[10] ^= 1;
    asio::write(socket, std::array<asio::const_buffer, 3>{asio::buffer(good),
                                                          asio::buffer(header.region),
                                                          asio::buffer(damaged)});
    EXPECT_TRUE(Closed(socket));
  }
  {  // A payload longer than the receiver accepts.
    FrameHeader huge = header;
    huge.length = 2 << 20;
    uint8_t bytes[FrameHeader::kBytes];
    EncodeFrameHeader(huge, bytes);
    tcp::socket socket = Raw();
    asio::write(socket, asio::buffer(bytes));
    EXPECT_TRUE(Closed(socket));
  }
  {  // Truncated: the sender goes away inside the payload.
    tcp::socket socket = Raw();
    asio::write(socket, std::array<asio::const_buffer, 3>{asio::buffer(good),
                                                          asio::buffer(header.region),
                                                          asio::buffer(payload.data(), 100)});
    socket.close();
  }
  ASSERT_TRUE(Eventually([&] { return server_->connections_rejected() == 4; }))
      << server_->connections_rejected();
  EXPECT_EQ(sink_.size(), 0u) << "a rejected frame reached the sink";
  // The sink heard of each, so that it stops waiting for frames the peer wrote behind them.
  const std::vector<CollectingSink::Closed> closed = sink_.closed();
  ASSERT_EQ(closed.size(), 4u);
  std::set<std::string> reasons;
  for (const CollectingSink::Closed& connection : closed) {
    EXPECT_EQ(connection.sender, std::nullopt) << "a plaintext peer is not known by its node";
    EXPECT_EQ(connection.address, "127.0.0.1");
    EXPECT_FALSE(connection.why.ok());
    reasons.insert(std::string(connection.why.message()).substr(0, 20));
  }
  EXPECT_EQ(reasons.size(), 4u) << "the sink was not told why each was closed";

  // The server still serves well-formed traffic.
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client =
      DataPlaneClient::Connect("127.0.0.1", server_->port(), 1);
  ASSERT_OK(client);
  ASSERT_OK((*client)->Send(HeaderFor(1, 1), payload));
  ASSERT_TRUE(Eventually([&] { return sink_.size() == 1; }));
  EXPECT_EQ(sink_.Get(1, 1).second, payload);
}

// A payload is checksummed a slice at a time as it lands: a byte damaged in the first, a middle
// or the last (short) slice of a payload of many is caught, and an intact one arrives whole.
TEST_F(DataPlaneTest, ADamagedByteInAnySliceOfALargePayloadIsCaught) {
  constexpr size_t kSlice = 256 << 10;  // the server's slice
  const std::vector<uint8_t> payload = testing::DeterministicBytes(77).Bytes(3 * kSlice + 12345);
  FrameHeader header = HeaderFor(2, 9);
  header.length = static_cast<uint32_t>(payload.size());
  header.payload_crc = erasure::Crc32c(payload.data(), payload.size());
  uint8_t encoded[FrameHeader::kBytes];
  EncodeFrameHeader(header, encoded);
  const std::vector<size_t> offsets = {0, kSlice - 1, kSlice, 2 * kSlice + 5, payload.size() - 1};
  for (size_t offset : offsets) {
    tcp::socket socket = Raw();
    std::vector<uint8_t> damaged = payload;
    damaged[offset] ^= 0x10;
    asio::write(socket, std::array<asio::const_buffer, 3>{asio::buffer(encoded),
                                                          asio::buffer(header.region),
                                                          asio::buffer(damaged)});
    EXPECT_TRUE(Closed(socket)) << "a byte damaged at " << offset << " was not caught";
  }
  ASSERT_TRUE(Eventually([&] { return server_->connections_rejected() == offsets.size(); }));
  EXPECT_EQ(sink_.size(), 0u);
  for (const CollectingSink::Closed& connection : sink_.closed()) {
    EXPECT_TRUE(absl::StrContains(connection.why.message(), "payload CRC-32C")) << connection.why;
  }
  tcp::socket socket = Raw();
  asio::write(socket, std::array<asio::const_buffer, 3>{asio::buffer(encoded),
                                                        asio::buffer(header.region),
                                                        asio::buffer(payload)});
  ASSERT_TRUE(Eventually([&] { return sink_.size() == 1; }));
  EXPECT_EQ(sink_.Get(2, 9).second, payload);
}

TEST_F(DataPlaneTest, ASinkErrorClosesTheConnectionAndTheClientReconnects) {
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client =
      DataPlaneClient::Connect("127.0.0.1", server_->port(), 1);
  ASSERT_OK(client);
  sink_.set_refuse(true);
  ASSERT_OK((*client)->Send(HeaderFor(2, 2), PayloadFor(2, 2)));  // queued before the refusal lands
  ASSERT_TRUE(Eventually([&] { return server_->connections_rejected() == 1; }));
  sink_.set_refuse(false);
  // The first write after the close may still be accepted by the kernel; within a few sends the
  // client sees the failure, drops the connection and reconnects.
  bool delivered = false;
  for (int attempt = 0; attempt < 10 && !delivered; ++attempt) {
    (*client)->Send(HeaderFor(3, attempt), PayloadFor(3, attempt)).IgnoreError();
    delivered = Eventually([&] { return sink_.size() > 0; });
  }
  EXPECT_TRUE(delivered);
}

// A server of its own, with the limits a test sets.
std::unique_ptr<DataPlaneServer> StartServer(DataPlaneOptions options, FrameSink* sink) {
  options.host = "127.0.0.1";
  absl::StatusOr<std::unique_ptr<DataPlaneServer>> server = DataPlaneServer::Start(options, sink);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

tcp::socket RawTo(asio::io_context& io, uint16_t port) {
  tcp::socket socket(io);
  socket.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  return socket;
}

// The header of frame (1, 1) as its sender writes it, sealed over its payload.
std::array<uint8_t, FrameHeader::kBytes> SealedHeaderBytes() {
  FrameHeader header = HeaderFor(1, 1);
  const std::vector<uint8_t> payload = PayloadFor(1, 1);
  header.length = static_cast<uint32_t>(payload.size());
  header.payload_crc = erasure::Crc32c(payload.data(), payload.size());
  std::array<uint8_t, FrameHeader::kBytes> bytes;
  EncodeFrameHeader(header, bytes.data());
  return bytes;
}

// Whether the server closes `socket` within 5 s: longer than the timeouts these tests set (at most
// 2 s), shorter than the defaults (10 s and more) a deadline ignored would leave.
bool ClosedByPeer(tcp::socket& socket) {
  pollfd readable{socket.native_handle(), POLLIN, 0};
  if (::poll(&readable, 1, 5000) != 1) return false;
  uint8_t byte;
  boost::system::error_code error;
  socket.read_some(asio::buffer(&byte, 1), error);
  return error == asio::error::eof || error == asio::error::connection_reset;
}

TEST(DataPlaneLimitsTest, ConnectionsBeyondTheLimitAreClosedAndFinishedOnesFreed) {
  CollectingSink sink;
  std::unique_ptr<DataPlaneServer> server = StartServer({.max_connections = 2}, &sink);
  ASSERT_NE(server, nullptr);
  asio::io_context io;
  std::vector<tcp::socket> held;
  held.push_back(RawTo(io, server->port()));
  held.push_back(RawTo(io, server->port()));
  ASSERT_TRUE(Eventually([&] { return server->connections_open() == 2; }));
  tcp::socket third = RawTo(io, server->port());
  EXPECT_TRUE(ClosedByPeer(third));
  EXPECT_EQ(server->connections_rejected(), 1u);
  // Connections that end are freed without waiting for the next one to arrive.
  held.clear();
  ASSERT_TRUE(Eventually([&] { return server->connections_open() == 0; }));
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client =
      DataPlaneClient::Connect("127.0.0.1", server->port(), 2);
  ASSERT_OK(client);
  ASSERT_OK((*client)->Send(HeaderFor(1, 1), PayloadFor(1, 1)));
  ASSERT_TRUE(Eventually([&] { return sink.size() == 1; }));
}

TEST(DataPlaneLimitsTest, AFrameThatStallsIsCutOffAndAnIdleConnectionClosed) {
  CollectingSink sink;
  std::unique_ptr<DataPlaneServer> server = StartServer(
      {.frame_timeout = absl::Milliseconds(200), .idle_timeout = absl::Milliseconds(300)}, &sink);
  ASSERT_NE(server, nullptr);
  asio::io_context io;
  const std::array<uint8_t, FrameHeader::kBytes> bytes = SealedHeaderBytes();
  tcp::socket stalled = RawTo(io, server->port());
  asio::write(stalled, asio::buffer(bytes.data(), FrameHeader::kBytes / 2));  // and nothing more
  tcp::socket idle = RawTo(io, server->port());
  EXPECT_TRUE(ClosedByPeer(stalled));
  EXPECT_TRUE(ClosedByPeer(idle));
  EXPECT_EQ(server->connections_rejected(), 1u) << "the stalled frame is a rejection, idling not";
  ASSERT_TRUE(Eventually([&] { return server->connections_open() == 0; }));
  EXPECT_EQ(sink.size(), 0u);
}

TEST(DataPlaneLimitsTest, ASendToAPeerThatStopsReadingFailsInTime) {
  // A listener that accepts and never reads: the kernel's buffers fill, then the sender waits.
  asio::io_context io;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client = DataPlaneClient::Connect(
      "127.0.0.1", acceptor.local_endpoint().port(), 1, absl::Milliseconds(300));
  ASSERT_OK(client);
  tcp::socket accepted = acceptor.accept();
  const std::vector<uint8_t> payload(4 << 20, 0x5a);
  absl::Status sent;
  for (int frame = 0; frame < 64 && sent.ok(); ++frame) sent = (*client)->Send(HeaderFor(1, 1), payload);
  ASSERT_FALSE(sent.ok()) << "64 frames of 4 MiB went into a connection no one reads";
  EXPECT_TRUE(absl::StrContains(sent.message(), "in time")) << sent;
}

TEST(DataPlaneLimitsTest, AcceptGoesOnAfterRunningOutOfDescriptors) {
  CollectingSink sink;
  std::unique_ptr<DataPlaneServer> server = StartServer({}, &sink);
  ASSERT_NE(server, nullptr);
  asio::io_context io;
  rlimit limit;
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  // Connected sockets wait in the listener's backlog while the server has no descriptor left.
  std::vector<tcp::socket> waiting;
  for (int i = 0; i < 3; ++i) {
    tcp::socket socket(io);
    socket.open(tcp::v4());
    waiting.push_back(std::move(socket));
  }
  rlimit tight = limit;
  tight.rlim_cur = 1;  // descriptor 0 is taken: accept() finds none free
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0);
  for (tcp::socket& socket : waiting) {
    socket.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), server->port()));
  }
  const bool refused = Eventually([&] { return server->connections_rejected() > 0; });
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &limit), 0);
  ASSERT_TRUE(refused) << "accept never failed for want of descriptors";
  // Descriptors are back: the waiting connections are served.
  FrameHeader header = HeaderFor(2, 3);
  const std::vector<uint8_t> payload = PayloadFor(2, 3);
  header.length = static_cast<uint32_t>(payload.size());
  header.payload_crc = erasure::Crc32c(payload.data(), payload.size());
  uint8_t bytes[FrameHeader::kBytes];
  EncodeFrameHeader(header, bytes);
  asio::write(waiting[0], std::array<asio::const_buffer, 3>{asio::buffer(bytes),
                                                            asio::buffer(header.region),
                                                            asio::buffer(payload)});
  ASSERT_TRUE(Eventually([&] { return sink.size() == 1; }));
  EXPECT_EQ(sink.Get(2, 3).second, payload);
}

// A sink that has payloads read straight into memory of its own: each frame's outcome is what
// Filled says, and Accept is never called.
class InPlaceSink : public FrameSink {
 public:
  static constexpr uint64_t kShortStripe = 99;
  // The memory of stripes from this one on is checked by its owner, not as frames land.
  static constexpr uint64_t kFirstOwnerChecked = 100;
  // Frames of stripes from this one on are no longer awaited: dropped.
  static constexpr uint64_t kFirstDropped = 200;

  absl::StatusOr<std::optional<InPlace>> Reserve(const FrameHeader& header,
                                                 std::optional<uint32_t>) override {
    if (header.stripe >= kFirstDropped) {
      return InPlace{.bytes = {}, .owner_checks = false, .drop = true};
    }
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<uint8_t>& memory = memory_[header.stripe];
    // Stripe kShortStripe is given one byte less than its payload: a sink at fault.
    memory.assign(header.stripe == kShortStripe ? header.length - 1 : header.length, 0);
    return InPlace{absl::MakeSpan(memory), header.stripe >= kFirstOwnerChecked};
  }
  void Filled(const FrameHeader& header, const absl::Status& checked) override {
    std::lock_guard<std::mutex> lock(mutex_);
    filled_[header.stripe] = checked;
  }
  absl::Status Accept(const FrameHeader&, absl::Span<const uint8_t>,
                      std::optional<uint32_t>) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++accepted_;
    return absl::OkStatus();
  }
  // What Filled said of the frame of `stripe` (nullopt: nothing yet), and its memory.
  std::optional<absl::Status> FilledOf(uint64_t stripe) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = filled_.find(stripe);
    if (it == filled_.end()) return std::nullopt;
    return it->second;
  }
  std::vector<uint8_t> MemoryOf(uint64_t stripe) {
    std::lock_guard<std::mutex> lock(mutex_);
    return memory_[stripe];
  }
  int accepted() {
    std::lock_guard<std::mutex> lock(mutex_);
    return accepted_;
  }

 private:
  std::mutex mutex_;
  std::map<uint64_t, std::vector<uint8_t>> memory_;
  std::map<uint64_t, absl::Status> filled_;
  int accepted_ = 0;
};

// A payload read into the sink's memory is checked there: a good one is reported filled, a
// corrupt or truncated one reported failed (the sink treats those bytes as garbage), memory of the
// wrong length never read into, and the connection of a failed one closed.
TEST(DataPlaneInPlaceTest, APayloadReadIntoTheSinksMemoryIsCheckedThere) {
  InPlaceSink sink;
  std::unique_ptr<DataPlaneServer> server = StartServer({}, &sink);
  ASSERT_NE(server, nullptr);
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client =
      DataPlaneClient::Connect("127.0.0.1", server->port(), 1);
  ASSERT_OK(client);
  const std::vector<uint8_t> payload = PayloadFor(1, 1);
  ASSERT_OK((*client)->Send(HeaderFor(1, 1), payload));
  ASSERT_TRUE(Eventually([&] { return sink.FilledOf(1).has_value(); }));
  EXPECT_OK(*sink.FilledOf(1));
  EXPECT_EQ(sink.MemoryOf(1), payload);

  asio::io_context io;
  FrameHeader header = HeaderFor(1, 2);
  const std::vector<uint8_t> second = PayloadFor(1, 2);
  ASSERT_OK(SealFrame(header, {absl::Span<const uint8_t>(second)}));
  uint8_t bytes[FrameHeader::kBytes];
  EncodeFrameHeader(header, bytes);
  std::vector<uint8_t> damaged = second;
  damaged[10] ^= 1;
  tcp::socket corrupt = RawTo(io, server->port());
  asio::write(corrupt,
              std::array<asio::const_buffer, 3>{asio::buffer(bytes), asio::buffer(header.region),
                                                asio::buffer(damaged)});
  ASSERT_TRUE(Eventually([&] { return sink.FilledOf(2).has_value(); }));
  EXPECT_STATUS(*sink.FilledOf(2), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(sink.FilledOf(2)->message(), "CRC")) << *sink.FilledOf(2);

  header = HeaderFor(1, 3);
  ASSERT_OK(SealFrame(header, {absl::Span<const uint8_t>(second)}));
  EncodeFrameHeader(header, bytes);
  {  // Truncated: the sender goes away inside the payload.
    tcp::socket truncated = RawTo(io, server->port());
    asio::write(truncated, std::array<asio::const_buffer, 3>{asio::buffer(bytes),
                                                             asio::buffer(header.region),
                                                             asio::buffer(second.data(), 100)});
  }
  ASSERT_TRUE(Eventually([&] { return sink.FilledOf(3).has_value(); }));
  EXPECT_STATUS(*sink.FilledOf(3), absl::StatusCode::kDataLoss);
  // Memory of another length than the payload is never read into.
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> other =
      DataPlaneClient::Connect("127.0.0.1", server->port(), 1);
  ASSERT_OK(other);
  (void)(*other)->Send(HeaderFor(1, InPlaceSink::kShortStripe), payload);
  ASSERT_TRUE(Eventually([&] { return sink.FilledOf(InPlaceSink::kShortStripe).has_value(); }));
  EXPECT_STATUS(*sink.FilledOf(InPlaceSink::kShortStripe), absl::StatusCode::kInternal);
  EXPECT_EQ(sink.MemoryOf(InPlaceSink::kShortStripe), std::vector<uint8_t>(payload.size() - 1, 0));
  ASSERT_TRUE(Eventually([&] { return server->connections_rejected() == 3; }))
      << server->connections_rejected();
  EXPECT_EQ(sink.accepted(), 0) << "a frame read in place was accepted from a buffer as well";
}

// Writes on `socket` a frame of stripe `stripe` whose payload does not match its CRC-32C (one bit
// flipped after sealing), then an intact frame of stripe 1; returns the damaged payload.
std::vector<uint8_t> WriteDamagedThenIntact(tcp::socket& socket, uint64_t stripe) {
  FrameHeader header = HeaderFor(1, stripe);
  const std::vector<uint8_t> payload = PayloadFor(1, stripe);
  EXPECT_OK(SealFrame(header, {absl::Span<const uint8_t>(payload)}));
  uint8_t bytes[FrameHeader::kBytes];
  EncodeFrameHeader(header, bytes);
  std::vector<uint8_t> damaged = payload;
  damaged[10] ^= 1;
  asio::write(socket,
              std::array<asio::const_buffer, 3>{asio::buffer(bytes), asio::buffer(header.region),
                                                asio::buffer(damaged)});
  FrameHeader next = HeaderFor(1, 1);
  const std::vector<uint8_t> intact = PayloadFor(1, 1);
  EXPECT_OK(SealFrame(next, {absl::Span<const uint8_t>(intact)}));
  EncodeFrameHeader(next, bytes);
  asio::write(socket,
              std::array<asio::const_buffer, 3>{asio::buffer(bytes), asio::buffer(next.region),
                                                asio::buffer(intact)});
  return damaged;
}

// Memory whose owner checks what lands in it (against checksums it trusts) is not checked as the
// frame lands: a payload that does not match its frame's CRC-32C is read in whole, reported
// filled, and the connection goes on to the next frame.
TEST(DataPlaneInPlaceTest, MemoryItsOwnerChecksIsNotCheckedAsItLands) {
  InPlaceSink sink;
  std::unique_ptr<DataPlaneServer> server = StartServer({}, &sink);
  ASSERT_NE(server, nullptr);
  asio::io_context io;
  tcp::socket socket = RawTo(io, server->port());
  const uint64_t stripe = InPlaceSink::kFirstOwnerChecked;
  const std::vector<uint8_t> damaged = WriteDamagedThenIntact(socket, stripe);
  ASSERT_TRUE(Eventually([&] { return sink.FilledOf(1).has_value(); }));
  EXPECT_OK(*sink.FilledOf(1));
  ASSERT_TRUE(sink.FilledOf(stripe).has_value());
  EXPECT_OK(*sink.FilledOf(stripe));
  EXPECT_EQ(sink.MemoryOf(stripe), damaged);
  EXPECT_EQ(server->connections_rejected(), 0u);
}

// A frame the sink no longer awaits is read whole and dropped, unchecked (its payload does not
// match its CRC-32C here): neither reported filled nor accepted, and the connection goes on.
TEST(DataPlaneInPlaceTest, AFrameTheSinkDropsIsReadWholeAndTheConnectionGoesOn) {
  InPlaceSink sink;
  std::unique_ptr<DataPlaneServer> server = StartServer({}, &sink);
  ASSERT_NE(server, nullptr);
  asio::io_context io;
  tcp::socket socket = RawTo(io, server->port());
  const uint64_t stripe = InPlaceSink::kFirstDropped;
  (void)WriteDamagedThenIntact(socket, stripe);
  ASSERT_TRUE(Eventually([&] { return sink.FilledOf(1).has_value(); }));
  EXPECT_OK(*sink.FilledOf(1));
  EXPECT_EQ(sink.MemoryOf(1), PayloadFor(1, 1));
  EXPECT_FALSE(sink.FilledOf(stripe).has_value());
  EXPECT_EQ(sink.accepted(), 0);
  EXPECT_EQ(server->connections_rejected(), 0u);
}

TEST(DataPlaneClientTest, UnreachablePeerAndBadArgumentsAreNamed) {
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client = DataPlaneClient::Connect("127.0.0.1", 1, 1);
  ASSERT_STATUS(client, absl::StatusCode::kUnavailable);
  EXPECT_NE(client.status().message().find("127.0.0.1:1"), std::string::npos);
  EXPECT_STATUS(DataPlaneClient::Connect("127.0.0.1", 1, 0), absl::StatusCode::kInvalidArgument);
  CollectingSink sink;
  EXPECT_STATUS(DataPlaneServer::Start({.host = "not-an-address"}, &sink),
                absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moesnap::daemon

namespace moesnap::daemon {
namespace {

// Mutual TLS on the data plane, with certificates of deploy/make-certs.sh: frames arrive byte for
// byte; a client refuses a server whose certificate names another node than the one it meant; a
// plaintext sender never reaches the sink of a TLS server, nor a TLS sender a plaintext server.
class DataPlaneTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<testing::JobCertificates>> job =
        testing::JobCertificates::Make("plane", 3);
    ASSERT_OK(job);
    job_ = *std::move(job);
    for (uint32_t node = 0; node < 3; ++node) {
      absl::StatusOr<std::shared_ptr<const PeerTls>> tls = PeerTls::Load(
          {job_->ca_file(), job_->cert_file(node), job_->key_file(node)}, "plane", node, 3);
      ASSERT_OK(tls);
      tls_.push_back(*tls);
    }
    server_ = StartServer({.tls = tls_[0]}, &sink_);
    ASSERT_NE(server_, nullptr);
  }

  std::unique_ptr<testing::JobCertificates> job_;
  std::vector<std::shared_ptr<const PeerTls>> tls_;
  CollectingSink sink_;
  std::unique_ptr<DataPlaneServer> server_;
};

TEST_F(DataPlaneTlsTest, FramesArriveByteForByte) {
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client = DataPlaneClient::Connect(
      "127.0.0.1", server_->port(), 2, absl::Seconds(30), {tls_[1], 0});
  ASSERT_OK(client);
  for (uint64_t stripe = 0; stripe < 20; ++stripe) {
    ASSERT_OK((*client)->Send(HeaderFor(1, stripe), PayloadFor(1, stripe)));
  }
  ASSERT_TRUE(Eventually([&] { return sink_.size() == 20; }));
  for (uint64_t stripe = 0; stripe < 20; ++stripe) {
    EXPECT_EQ(sink_.Get(1, stripe).second, PayloadFor(1, stripe)) << stripe;
    EXPECT_EQ(sink_.Get(1, stripe).first, HeaderFor(1, stripe).region);
  }
  // The sink is told the node the client's certificate names.
  EXPECT_EQ(sink_.senders(), std::set<std::optional<uint32_t>>{1u});
  EXPECT_EQ(server_->connections_rejected(), 0u);
}

// A TLS write's records go out gathered, 512 KiB a send: frames shorter than a record, across a
// record, just under and over one send, and several sends long all arrive as they were sent.
TEST_F(DataPlaneTlsTest, FramesShorterAndLongerThanOneGatheredSendArriveByteForByte) {
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client = DataPlaneClient::Connect(
      "127.0.0.1", server_->port(), 1, absl::Seconds(30), {tls_[1], 0});
  ASSERT_OK(client);
  const std::vector<size_t> sizes = {1,          16383,           16385, (512 << 10) - 40,
                                     512 << 10,  (512 << 10) + 1, (3 << 20) + 17};
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_OK((*client)->Send(HeaderFor(1, i), testing::DeterministicBytes(i).Bytes(sizes[i])));
  }
  ASSERT_TRUE(Eventually([&] { return sink_.size() == sizes.size(); }));
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(sink_.Get(1, i).second, testing::DeterministicBytes(i).Bytes(sizes[i])) << sizes[i];
  }
  EXPECT_EQ(server_->connections_rejected(), 0u);
}

// A sink that holds the connection's thread in Accept until released: the server stops reading.
class HoldingSink : public FrameSink {
 public:
  absl::Status Accept(const FrameHeader&, absl::Span<const uint8_t>,
                      std::optional<uint32_t>) override {
    std::unique_lock<std::mutex> lock(mutex_);
    released_.wait(lock, [&] { return released; });
    return absl::OkStatus();
  }
  void ConnectionClosed(std::optional<uint32_t>, const std::string&,
                        const absl::Status&) override {}
  void Release() {
    std::lock_guard<std::mutex> lock(mutex_);
    released = true;
    released_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable released_;
  bool released = false;
};

// Gathered records wait for room by the send's deadline as plaintext writes do: a TLS send to a
// peer that stopped reading fails in time.
TEST_F(DataPlaneTlsTest, ASendToAPeerThatStopsReadingFailsInTime) {
  HoldingSink holding;
  std::unique_ptr<DataPlaneServer> server = StartServer({.tls = tls_[0]}, &holding);
  ASSERT_NE(server, nullptr);
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client = DataPlaneClient::Connect(
      "127.0.0.1", server->port(), 1, absl::Milliseconds(300), {tls_[1], 0});
  ASSERT_OK(client);
  const std::vector<uint8_t> payload(4 << 20, 0x5a);
  absl::Status sent;
  for (int frame = 0; frame < 64 && sent.ok(); ++frame) sent = (*client)->Send(HeaderFor(1, 1), payload);
  holding.Release();
  ASSERT_FALSE(sent.ok()) << "64 frames of 4 MiB went into a connection no one reads";
  EXPECT_TRUE(absl::StrContains(sent.message(), "in time")) << sent;
}

TEST_F(DataPlaneTlsTest, AClientRefusesAServerNamingAnotherNode) {
  // Node 1 meant to reach node 2, and node 0 answered on that address.
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> client = DataPlaneClient::Connect(
      "127.0.0.1", server_->port(), 1, absl::Seconds(30), {tls_[1], 2});
  EXPECT_STATUS(client, absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(absl::StrContains(client.status().message(),
                                "names moesnap://plane/node/0, not the node meant"))
      << client.status();
}

// Every wait of a TLS connection ends by its deadline, as a plaintext one's does: a peer silent
// through the handshake is refused at the handshake timeout; an admitted peer whose frame stalls
// is cut off at the frame timeout (a rejection); an admitted peer that idles is closed at the idle
// timeout (not a rejection).
TEST_F(DataPlaneTlsTest, ASilentHandshakeAStalledFrameAndAnIdlePeerAreClosedInTime) {
  CollectingSink sink;
  std::unique_ptr<DataPlaneServer> server =
      // Each timeout far longer than what it must let pass on a busy machine (a handshake, the
      // test's write after one), far shorter than ClosedByPeer's bound.
      StartServer({.frame_timeout = absl::Milliseconds(200),
                   .idle_timeout = absl::Seconds(2),
                   .tls = tls_[0],
                   .handshake_timeout = absl::Seconds(1)},
                  &sink);
  ASSERT_NE(server, nullptr);
  asio::io_context io;
  asio::ssl::context context(asio::ssl::context::tls_client);
  context.load_verify_file(job_->ca_file());
  context.use_certificate_chain_file(job_->cert_file(1));
  context.use_private_key_file(job_->key_file(1), asio::ssl::context::pem);
  context.set_verify_mode(asio::ssl::verify_peer);
  // A peer admitted by the server: its handshake done, the server's acceptance read.
  auto admitted = [&] {
    auto stream = std::make_unique<asio::ssl::stream<tcp::socket>>(io, context);
    stream->next_layer() = RawTo(io, server->port());
    stream->handshake(asio::ssl::stream_base::client);
    uint8_t accepted = 0;
    asio::read(*stream, asio::buffer(&accepted, 1));
    EXPECT_EQ(accepted, 0x01);
    return stream;
  };
  const std::array<uint8_t, FrameHeader::kBytes> bytes = SealedHeaderBytes();

  tcp::socket silent = RawTo(io, server->port());
  std::unique_ptr<asio::ssl::stream<tcp::socket>> stalled = admitted();
  asio::write(*stalled, asio::buffer(bytes.data(), FrameHeader::kBytes / 2));  // and nothing more
  std::unique_ptr<asio::ssl::stream<tcp::socket>> idle = admitted();
  EXPECT_TRUE(ClosedByPeer(silent));
  EXPECT_TRUE(ClosedByPeer(stalled->next_layer()));
  EXPECT_TRUE(ClosedByPeer(idle->next_layer()));
  EXPECT_EQ(server->connections_rejected(), 2u)
      << "the silent handshake and the stalled frame are rejections, idling not";
  ASSERT_TRUE(Eventually([&] { return server->connections_open() == 0; }));
  EXPECT_EQ(sink.size(), 0u);
}

TEST_F(DataPlaneTlsTest, PlaintextNeverReachesATlsServerNorTlsAPlaintextOne) {
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> plaintext =
      DataPlaneClient::Connect("127.0.0.1", server_->port(), 1);
  ASSERT_OK(plaintext);  // no handshake: the server refuses at the first bytes
  (*plaintext)->Send(HeaderFor(1, 0), PayloadFor(1, 0)).IgnoreError();
  EXPECT_TRUE(Eventually([&] { return server_->connections_rejected() == 1; }));
  EXPECT_EQ(sink_.size(), 0u);

  CollectingSink plain_sink;
  std::unique_ptr<DataPlaneServer> plain_server = StartServer({}, &plain_sink);
  ASSERT_NE(plain_server, nullptr);
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> encrypted = DataPlaneClient::Connect(
      "127.0.0.1", plain_server->port(), 1, absl::Seconds(30), {tls_[1], 0});
  EXPECT_FALSE(encrypted.ok());
  EXPECT_EQ(plain_sink.size(), 0u);
}

}  // namespace
}  // namespace moesnap::daemon
