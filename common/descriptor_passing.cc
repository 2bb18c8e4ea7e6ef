// SendWithDescriptors / ReceiveWithDescriptors: sendmsg and recvmsg with one SCM_RIGHTS header.
#include "common/descriptor_passing.h"

#include <sys/socket.h>

#include <cstring>

namespace moesnap {

ssize_t SendWithDescriptors(int socket, const void* data, size_t bytes, const int* fds,
                            size_t count, int flags) {
  iovec payload{const_cast<void*>(data), bytes};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPassedDescriptors)] = {};
  msghdr message{};
  message.msg_iov = &payload;
  message.msg_iovlen = 1;
  if (count > kMaxPassedDescriptors) count = kMaxPassedDescriptors;
  if (count > 0) {
    message.msg_control = control;
    message.msg_controllen = CMSG_SPACE(sizeof(int) * count);
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int) * count);
    std::memcpy(CMSG_DATA(header), fds, sizeof(int) * count);
  }
  return sendmsg(socket, &message, flags);
}

ReceivedMessage ReceiveWithDescriptors(int socket, void* buffer, size_t capacity, int flags) {
  iovec payload{buffer, capacity};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPassedDescriptors)];
  msghdr message{};
  message.msg_iov = &payload;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  ReceivedMessage received;
  received.bytes = recvmsg(socket, &message, flags | MSG_CMSG_CLOEXEC);
  if (received.bytes < 0) return received;
  received.truncated = (message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0;
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
       header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(header) + i * sizeof(int), sizeof(int));
      received.descriptors.push_back(fd);
    }
  }
  return received;
}

}  // namespace moesnap
