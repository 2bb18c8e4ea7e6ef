// SendWithDescriptors / ReceiveWithDescriptors over a real socketpair: the bytes and every attached
// descriptor arrive (as new descriptors of the same files), and a message whose descriptors do not
// fit says so instead of losing them silently.
#include "common/descriptor_passing.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <vector>

namespace moesnap {
namespace {

class DescriptorPassingTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, ends_), 0); }
  void TearDown() override {
    for (int end : ends_) close(end);
  }

  int ends_[2] = {-1, -1};
};

ino_t InodeOf(int fd) {
  struct stat info {};
  EXPECT_EQ(fstat(fd, &info), 0);
  return info.st_ino;
}

TEST_F(DescriptorPassingTest, TheBytesAndEveryDescriptorArrive) {
  int pipe_ends[2];
  ASSERT_EQ(pipe(pipe_ends), 0);
  const char payload[] = "handoff";
  ASSERT_EQ(SendWithDescriptors(ends_[0], payload, sizeof(payload), pipe_ends, 2, 0),
            static_cast<ssize_t>(sizeof(payload)));
  char buffer[64] = {};
  ReceivedMessage received = ReceiveWithDescriptors(ends_[1], buffer, sizeof(buffer), 0);
  ASSERT_EQ(received.bytes, static_cast<ssize_t>(sizeof(payload)));
  EXPECT_FALSE(received.truncated);
  EXPECT_STREQ(buffer, "handoff");
  ASSERT_EQ(received.descriptors.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_NE(received.descriptors[i], pipe_ends[i]);  // new descriptors ...
    EXPECT_EQ(InodeOf(received.descriptors[i]), InodeOf(pipe_ends[i]));  // ... of the same files
    EXPECT_EQ(fcntl(received.descriptors[i], F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
    close(received.descriptors[i]);
    close(pipe_ends[i]);
  }
}

TEST_F(DescriptorPassingTest, AMessageWithoutDescriptorsCarriesNone) {
  ASSERT_EQ(SendWithDescriptors(ends_[0], "x", 1, nullptr, 0, 0), 1);
  char buffer[8];
  ReceivedMessage received = ReceiveWithDescriptors(ends_[1], buffer, sizeof(buffer), 0);
  EXPECT_EQ(received.bytes, 1);
  EXPECT_FALSE(received.truncated);
  EXPECT_TRUE(received.descriptors.empty());
}

TEST_F(DescriptorPassingTest, AMessageLongerThanTheBufferIsMarkedTruncated) {
  const std::vector<char> payload(32, 'p');
  ASSERT_EQ(SendWithDescriptors(ends_[0], payload.data(), payload.size(), nullptr, 0, 0), 32);
  char buffer[8];
  ReceivedMessage received = ReceiveWithDescriptors(ends_[1], buffer, sizeof(buffer), 0);
  EXPECT_EQ(received.bytes, 8);
  EXPECT_TRUE(received.truncated);
}

TEST_F(DescriptorPassingTest, AClosedPeerReadsAsTheEnd) {
  close(ends_[0]);
  ends_[0] = -1;
  char buffer[8];
  ReceivedMessage received = ReceiveWithDescriptors(ends_[1], buffer, sizeof(buffer), 0);
  EXPECT_EQ(received.bytes, 0);
  EXPECT_TRUE(received.descriptors.empty());
}

}  // namespace
}  // namespace moesnap
