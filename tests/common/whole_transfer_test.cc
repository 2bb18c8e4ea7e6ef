// WholeTransfer offers a stream every remaining byte in each call: a frame of a megabyte goes to
// the socket in one call when the socket takes it, in as many as it needs when it takes part, and
// nothing more is asked once a call fails. The stream here records what each call was offered.
#include "common/whole_transfer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <boost/asio.hpp>
#include <cstdint>
#include <vector>

namespace moesnap {
namespace {

namespace asio = boost::asio;

// A stream that takes (or gives) at most `per_call` bytes a call, and fails from call `fail_at`.
class RecordingStream {
 public:
  explicit RecordingStream(size_t per_call, size_t fail_at = SIZE_MAX)
      : per_call_(per_call), fail_at_(fail_at) {}

  template <typename Buffers>
  size_t write_some(const Buffers& buffers, boost::system::error_code& error) {
    if (Fails(buffers, error)) return 0;
    return Take(buffers, [&](const void* data, size_t bytes) {
      const auto* from = static_cast<const uint8_t*>(data);
      written_.insert(written_.end(), from, from + bytes);
    });
  }
  template <typename Buffers>
  size_t read_some(const Buffers& buffers, boost::system::error_code& error) {
    if (Fails(buffers, error)) return 0;
    // Each call's bytes hold its number (0 for the first).
    return Take(buffers, [&](void* data, size_t bytes) {
      std::fill_n(static_cast<uint8_t*>(data), bytes, static_cast<uint8_t>(calls() - 1));
    });
  }

  // The bytes each call was offered, in order.
  const std::vector<size_t>& offered() const { return offered_; }
  size_t calls() const { return offered_.size(); }
  const std::vector<uint8_t>& written() const { return written_; }

 private:
  // Hands `each` the buffers in order, up to per_call_ bytes in all; returns how many.
  template <typename Buffers, typename Each>
  size_t Take(const Buffers& buffers, Each each) {
    size_t taken = 0;
    for (auto buffer = asio::buffer_sequence_begin(buffers);
         buffer != asio::buffer_sequence_end(buffers) && taken < per_call_; ++buffer) {
      const size_t bytes = std::min(buffer->size(), per_call_ - taken);
      each(buffer->data(), bytes);
      taken += bytes;
    }
    return taken;
  }
  // Records what a call is offered; from call fail_at on, fails it.
  template <typename Buffers>
  bool Fails(const Buffers& buffers, boost::system::error_code& error) {
    offered_.push_back(asio::buffer_size(buffers));
    if (offered_.size() <= fail_at_) return false;
    error = asio::error::connection_reset;
    return true;
  }

  const size_t per_call_;
  const size_t fail_at_;
  std::vector<size_t> offered_;
  std::vector<uint8_t> written_;
};

constexpr size_t kHeaderBytes = 64;
constexpr size_t kPayloadBytes = 1 << 20;

// A frame as the data plane writes it: a header, a region name and the payload.
struct Frame {
  std::vector<uint8_t> header = std::vector<uint8_t>(kHeaderBytes, 0x11);
  std::vector<uint8_t> region = std::vector<uint8_t>(7, 0x22);
  std::vector<uint8_t> payload;
  Frame() : payload(kPayloadBytes) {
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 131 + 7);
  }
  std::array<asio::const_buffer, 3> Buffers() const {
    return {asio::buffer(header), asio::buffer(region), asio::buffer(payload)};
  }
  std::vector<uint8_t> Bytes() const {
    std::vector<uint8_t> bytes = header;
    bytes.insert(bytes.end(), region.begin(), region.end());
    bytes.insert(bytes.end(), payload.begin(), payload.end());
    return bytes;
  }
};

TEST(WholeTransferTest, AFrameIsOfferedWholeInOneCallWhenTheStreamTakesIt) {
  const Frame frame;
  RecordingStream stream(SIZE_MAX);
  boost::system::error_code error;
  const size_t written = asio::write(stream, frame.Buffers(), WholeTransfer(), error);
  EXPECT_FALSE(error);
  EXPECT_EQ(written, frame.Bytes().size());
  EXPECT_EQ(stream.offered(), std::vector<size_t>{frame.Bytes().size()});
  EXPECT_EQ(stream.written(), frame.Bytes());
}

TEST(WholeTransferTest, AStreamTakingPartIsOfferedTheRestEachCallUntilEveryByteIsWritten) {
  const Frame frame;
  const size_t total = frame.Bytes().size();
  constexpr size_t kTaken = 300 << 10;  // a socket buffer's room at a time
  RecordingStream stream(kTaken);
  boost::system::error_code error;
  EXPECT_EQ(asio::write(stream, frame.Buffers(), WholeTransfer(), error), total);
  EXPECT_FALSE(error);
  std::vector<size_t> expected;
  for (size_t left = total; left > 0; left -= std::min(left, kTaken)) expected.push_back(left);
  EXPECT_EQ(stream.offered(), expected);
  EXPECT_EQ(stream.written(), frame.Bytes());
}

TEST(WholeTransferTest, AReadIsOfferedTheWholeBufferAndFillsItAcrossCalls) {
  std::vector<uint8_t> into(kPayloadBytes);
  RecordingStream whole(SIZE_MAX);
  boost::system::error_code error;
  EXPECT_EQ(asio::read(whole, asio::buffer(into), WholeTransfer(), error), into.size());
  EXPECT_FALSE(error);
  EXPECT_EQ(whole.offered(), std::vector<size_t>{kPayloadBytes});

  constexpr size_t kGiven = 400 << 10;
  RecordingStream parts(kGiven);
  EXPECT_EQ(asio::read(parts, asio::buffer(into), WholeTransfer(), error), into.size());
  EXPECT_FALSE(error);
  EXPECT_EQ(parts.offered(),
            (std::vector<size_t>{kPayloadBytes, kPayloadBytes - kGiven, kPayloadBytes - 2 * kGiven}));
  // Each call's bytes landed after the last call's.
  EXPECT_EQ(into[0], 0);
  EXPECT_EQ(into[kGiven], 1);
  EXPECT_EQ(into[kPayloadBytes - 1], 2);
}

TEST(WholeTransferTest, AFailedCallEndsTheTransferWithItsError) {
  const Frame frame;
  constexpr size_t kTaken = 100 << 10;
  RecordingStream stream(kTaken, /*fail_at=*/2);
  boost::system::error_code error;
  EXPECT_EQ(asio::write(stream, frame.Buffers(), WholeTransfer(), error), 2 * kTaken);
  EXPECT_EQ(error, asio::error::connection_reset);
  EXPECT_EQ(stream.calls(), 3u);  // two that took their part, and the one that failed
}

}  // namespace
}  // namespace moesnap
