// A completion condition for asio::read and asio::write that asks for every remaining byte in
// each system call. asio's own transfer_all caps each call at 64 KiB: a frame of a megabyte took
// sixteen sends (on a non-blocking socket, as many waits for room) and as many receives.
#ifndef MOESNAP_COMMON_WHOLE_TRANSFER_H_
#define MOESNAP_COMMON_WHOLE_TRANSFER_H_

#include <boost/system/error_code.hpp>
#include <cstddef>
#include <limits>

namespace moesnap {

struct WholeTransfer {
  size_t operator()(const boost::system::error_code& error, size_t /*transferred*/) const {
    return error ? 0 : std::numeric_limits<size_t>::max();
  }
};

}  // namespace moesnap

#endif  // MOESNAP_COMMON_WHOLE_TRANSFER_H_
