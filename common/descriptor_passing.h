// Messages with file descriptors attached (SCM_RIGHTS) over a Unix socket: both sides of the memory
// handoff (common/memory_handoff_wire.h) send and receive them this way.
#ifndef MOESNAP_COMMON_DESCRIPTOR_PASSING_H_
#define MOESNAP_COMMON_DESCRIPTOR_PASSING_H_

#include <sys/types.h>

#include <cstddef>
#include <vector>

namespace moesnap {

// Most descriptors one message carries.
inline constexpr size_t kMaxPassedDescriptors = 64;

// Sends `bytes` bytes of `data` with `count` descriptors of `fds` attached (at most
// kMaxPassedDescriptors; the caller keeps them). Returns sendmsg's result.
ssize_t SendWithDescriptors(int socket, const void* data, size_t bytes, const int* fds,
                            size_t count, int flags);

struct ReceivedMessage {
  ssize_t bytes = 0;               // recvmsg's result: the bytes put in the buffer, 0 or -1
  bool truncated = false;          // the message or its descriptors did not fit (MSG_(C)TRUNC)
  std::vector<int> descriptors;    // attached ones, now the caller's (close-on-exec)
};
// Receives one message into `buffer` (`capacity` bytes) with up to kMaxPassedDescriptors attached.
ReceivedMessage ReceiveWithDescriptors(int socket, void* buffer, size_t capacity, int flags);

}  // namespace moesnap

#endif  // MOESNAP_COMMON_DESCRIPTOR_PASSING_H_
