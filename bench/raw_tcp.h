// The physical limit of every byte that crosses between daemons: a raw TCP stream on loopback, one
// connection, whole chunks written and read with the same system calls the data plane makes and no
// framing. Suites measure it in the same run as the figure it bounds.
#ifndef MOESNAP_BENCH_RAW_TCP_H_
#define MOESNAP_BENCH_RAW_TCP_H_

#include <atomic>
#include <boost/asio.hpp>
#include <cstdint>
#include <thread>
#include <vector>

namespace moesnap::bench {

class RawTcpStream {
 public:
  explicit RawTcpStream(size_t chunk_bytes)
      : chunk_bytes_(chunk_bytes),
        acceptor_(io_, boost::asio::ip::tcp::endpoint(boost::asio::ip::make_address("127.0.0.1"), 0)),
        socket_(io_) {
    receiver_ = std::thread([this] {
      boost::asio::ip::tcp::socket socket(io_);
      acceptor_.accept(socket);
      std::vector<uint8_t> buffer(chunk_bytes_);
      boost::system::error_code error;
      while (true) {
        boost::asio::read(socket, boost::asio::buffer(buffer), error);
        if (error) return;
        received_ += chunk_bytes_;
      }
    });
    socket_.connect(acceptor_.local_endpoint());
    socket_.set_option(boost::asio::ip::tcp::no_delay(true));
  }
  ~RawTcpStream() {
    socket_.close();
    receiver_.join();
  }

  // Writes `chunks` chunks of `chunk` and waits until the receiver has read them all.
  void Send(const uint8_t* chunk, int chunks) {
    for (int i = 0; i < chunks; ++i) boost::asio::write(socket_, boost::asio::buffer(chunk, chunk_bytes_));
    sent_ += chunk_bytes_ * chunks;
    while (received_.load(std::memory_order_acquire) < sent_) std::this_thread::yield();
  }

 private:
  const size_t chunk_bytes_;
  boost::asio::io_context io_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::ip::tcp::socket socket_;
  std::thread receiver_;
  std::atomic<uint64_t> received_{0};
  uint64_t sent_ = 0;
};

}  // namespace moesnap::bench

#endif  // MOESNAP_BENCH_RAW_TCP_H_
