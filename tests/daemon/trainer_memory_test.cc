// TrainerMemory and TrainerSessions in process: what is mapped, and which rank's session may use it.
#include "daemon/trainer_memory.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

// A memfd of `bytes` bytes, sealed against shrinking when asked.
int SharedFile(size_t bytes, bool sealed) {
  const int fd = memfd_create("trainer-memory-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  if (sealed) EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  return fd;
}

TEST(TrainerMemoryTest, MapsTheWholeFileSharedWithTheTrainer) {
  const int fd = SharedFile(8192, /*sealed=*/true);
  void* trainer = mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(trainer, MAP_FAILED);
  absl::StatusOr<std::shared_ptr<TrainerMemory>> memory = TrainerMemory::Map(fd, geteuid(), {});
  close(fd);  // the mapping stays
  ASSERT_OK(memory);
  EXPECT_EQ((*memory)->bytes(), 8192u);
  EXPECT_TRUE((*memory)->shrink_sealed());
  std::memcpy(trainer, "weights", 7);
  EXPECT_EQ(std::memcmp((*memory)->data(), "weights", 7), 0);
  std::memcpy((*memory)->data() + 4096, "restored", 8);
  EXPECT_EQ(std::memcmp(static_cast<char*>(trainer) + 4096, "restored", 8), 0);
  munmap(trainer, 8192);
}

TEST(TrainerMemoryTest, RefusesWhatIsNotASharedMemoryFile) {
  int pipe_ends[2];
  ASSERT_EQ(pipe(pipe_ends), 0);
  EXPECT_STATUS(TrainerMemory::Map(pipe_ends[0], geteuid(), {}),
                absl::StatusCode::kInvalidArgument);
  close(pipe_ends[0]);
  close(pipe_ends[1]);
  const int empty = SharedFile(0, false);
  EXPECT_STATUS(TrainerMemory::Map(empty, geteuid(), {}), absl::StatusCode::kInvalidArgument);
  close(empty);
  const int unsealed = SharedFile(4096, false);
  absl::StatusOr<std::shared_ptr<TrainerMemory>> memory =
      TrainerMemory::Map(unsealed, geteuid(), {});
  close(unsealed);
  ASSERT_OK(memory);
  EXPECT_FALSE((*memory)->shrink_sealed());
}

std::shared_ptr<TrainerMemory> Memory() {
  const int fd = SharedFile(4096, true);
  absl::StatusOr<std::shared_ptr<TrainerMemory>> memory = TrainerMemory::Map(fd, geteuid(), {});
  close(fd);
  EXPECT_OK(memory);
  return *memory;
}

constexpr TrainerSessions::Caller kTrainer{.uid = 1000, .pid = 4242};

TEST(TrainerMemoryTest, RefusesAnotherUsersFileAndTheDaemonsOwn) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  const int fd = SharedFile(4096, true);
  ASSERT_EQ(fchown(fd, 65534, 65534), 0);
  absl::StatusOr<std::shared_ptr<TrainerMemory>> memory = TrainerMemory::Map(fd, 1000, {});
  ASSERT_STATUS(memory, absl::StatusCode::kPermissionDenied);
  EXPECT_NE(memory.status().message().find("owned by uid 65534"), std::string::npos)
      << memory.status();
  EXPECT_OK(TrainerMemory::Map(fd, 65534, {}));
  struct stat info {};
  ASSERT_EQ(fstat(fd, &info), 0);
  memory = TrainerMemory::Map(fd, 65534, {{info.st_dev, info.st_ino}});
  ASSERT_STATUS(memory, absl::StatusCode::kPermissionDenied);
  EXPECT_NE(memory.status().message().find("moesnapd's own"), std::string::npos) << memory.status();
  close(fd);
}

TEST(TrainerSessionsTest, ALiveRankIsNotTakenByAnotherUser) {
  TrainerSessions sessions;
  absl::StatusOr<TrainerSessions::Session> held = sessions.Start(3, kTrainer);
  ASSERT_OK(held);
  ASSERT_OK(sessions.Add(held->token, {}));  // its memory connection is open
  absl::StatusOr<TrainerSessions::Session> taken = sessions.Start(3, {.uid = 1001, .pid = 77});
  ASSERT_STATUS(taken, absl::StatusCode::kPermissionDenied);
  for (const char* mentions : {"rank 3", "uid 1000 (pid 4242)", "uid 1001 (pid 77)"}) {
    EXPECT_NE(taken.status().message().find(mentions), std::string::npos) << taken.status();
  }
  EXPECT_EQ(*sessions.RankOf(held->token), 3u);
  EXPECT_OK(sessions.Start(4, {.uid = 1001, .pid = 77}));  // another rank is free

  // The same user's new process takes over (it could read the trainer's memory anyway) ...
  absl::StatusOr<TrainerSessions::Session> same = sessions.Start(3, {.uid = 1000, .pid = 4243});
  ASSERT_OK(same);
  EXPECT_STATUS(sessions.RankOf(held->token), absl::StatusCode::kNotFound);
  ASSERT_OK(sessions.Add(same->token, {}));
  // ... and once its trainer disconnects, the rank is free for anyone.
  ASSERT_TRUE(sessions.End(same->token).has_value());
  absl::StatusOr<TrainerSessions::Session> later = sessions.Start(3, {.uid = 1001, .pid = 78});
  ASSERT_OK(later);
  EXPECT_EQ(*sessions.RankOf(later->token), 3u);
  EXPECT_OK(sessions.Start(3, {.uid = 0, .pid = 1}));  // root may always
}

TEST(TrainerSessionsTest, MemoryIsFoundOnlyByItsRanksCurrentSession) {
  TrainerSessions sessions;
  absl::StatusOr<TrainerSessions::Session> started = sessions.Start(3, kTrainer);
  ASSERT_OK(started);
  const TrainerSessions::Session first = *started;
  EXPECT_EQ(first.token.size(), 16u);
  absl::StatusOr<uint64_t> id = sessions.Add(first.token, {Memory(), Memory()});
  ASSERT_OK(id);
  EXPECT_OK(sessions.Find(3, *id));
  EXPECT_OK(sessions.Find(3, *id + 1));
  EXPECT_STATUS(sessions.Find(3, *id + 2), absl::StatusCode::kNotFound);
  EXPECT_STATUS(sessions.Find(4, *id), absl::StatusCode::kNotFound);  // another rank's memory

  // A new process of the rank: the old session's memory and token are gone.
  started = sessions.Start(3, kTrainer);
  ASSERT_OK(started);
  const TrainerSessions::Session second = *started;
  EXPECT_GT(second.number, first.number);
  EXPECT_NE(second.token, first.token);
  EXPECT_STATUS(sessions.Find(3, *id), absl::StatusCode::kNotFound);
  EXPECT_STATUS(sessions.Add(first.token, {Memory()}), absl::StatusCode::kNotFound);
  EXPECT_EQ(sessions.End(first.token), std::nullopt);  // the old process's late goodbye

  absl::StatusOr<uint64_t> again = sessions.Add(second.token, {Memory()});
  ASSERT_OK(again);
  EXPECT_GT(*again, *id + 1);  // ids are never reused
  const auto ended = sessions.End(second.token);
  ASSERT_TRUE(ended.has_value());
  EXPECT_EQ(ended->first, 3u);
  EXPECT_EQ(ended->second, second.number);
  EXPECT_STATUS(sessions.Find(3, *again), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace moesnap::daemon
