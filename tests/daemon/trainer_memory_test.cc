// TrainerMemory and TrainerSessions in process: what is mapped, and which rank's session may use it.
#include "daemon/trainer_memory.h"
#include "daemon/abandon_mark.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstddef>
#include <cstring>
#include <string>

#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

// A memfd of `bytes` bytes, sealed against shrinking when asked, and against growing too when
// `fixed` (as the client's files are).
int SharedFile(size_t bytes, bool sealed, bool fixed = false) {
  const int fd = memfd_create("trainer-memory-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  if (sealed) {
    EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | (fixed ? F_SEAL_GROW : 0)), 0);
  }
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

TEST(AbandonMarkTest, IsAnAlignedCountWithinMemoryTheTrainerCannotShrink) {
  const int fd = SharedFile(4096, /*sealed=*/true, /*fixed=*/true);
  absl::StatusOr<std::shared_ptr<TrainerMemory>> sealed = TrainerMemory::Map(fd, geteuid(), {});
  close(fd);
  ASSERT_OK(sealed);
  v1::AbandonMark request;
  request.set_take(1);
  for (uint64_t offset : {uint64_t{4}, uint64_t{4096}, uint64_t{4092}, ~uint64_t{7}}) {
    request.set_offset(offset);
    EXPECT_STATUS(AbandonMark::In(*sealed, request), absl::StatusCode::kInvalidArgument) << offset;
  }
  request.set_offset(4088);
  EXPECT_OK(AbandonMark::In(*sealed, request));
  request.set_take(0);  // takes are numbered from 1: take 0 would abort every capture
  EXPECT_STATUS(AbandonMark::In(*sealed, request), absl::StatusCode::kInvalidArgument);
  request.set_take(1);

  const int unsealed_fd = SharedFile(4096, /*sealed=*/false);
  absl::StatusOr<std::shared_ptr<TrainerMemory>> unsealed =
      TrainerMemory::Map(unsealed_fd, geteuid(), {});
  close(unsealed_fd);
  ASSERT_OK(unsealed);
  request.set_offset(0);
  EXPECT_STATUS(AbandonMark::In(*unsealed, request), absl::StatusCode::kInvalidArgument);
}

TEST(AbandonMarkTest, ATakeIsAbandonedOnceTheTrainersCountReachesIt) {
  const int fd = SharedFile(4096, /*sealed=*/true, /*fixed=*/true);
  auto* trainer = static_cast<uint64_t*>(
      mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ASSERT_NE(trainer, MAP_FAILED);
  absl::StatusOr<std::shared_ptr<TrainerMemory>> memory = TrainerMemory::Map(fd, geteuid(), {});
  close(fd);
  ASSERT_OK(memory);
  v1::AbandonMark request;
  request.set_offset(8);
  request.set_take(2);
  absl::StatusOr<AbandonMark> mark = AbandonMark::In(*memory, request);
  ASSERT_OK(mark);
  EXPECT_FALSE(mark->Abandoned());
  trainer[1] = 1;  // an earlier take given up
  EXPECT_FALSE(mark->Abandoned());
  trainer[1] = 2;
  EXPECT_TRUE(mark->Abandoned());
  trainer[1] = 7;  // a later one: this take was given up before it
  EXPECT_TRUE(mark->Abandoned());
  munmap(trainer, 4096);
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
  EXPECT_EQ(ended->rank, 3u);
  EXPECT_EQ(ended->number, second.number);
  EXPECT_EQ(ended->kept_bytes, 0u);  // nothing is kept without a retention
  EXPECT_STATUS(sessions.Find(3, *again), absl::StatusCode::kNotFound);
}

constexpr uint64_t kHandedOn = TrainerMemory::kMinKeptBytes;
// The store's answer when no copy of a rank's memory is in flight.
constexpr bool kNoCopyInFlight = false;

// A file the client would allocate: fixed size, mapped by a daemon that keeps exited trainers'
// memory; `text` written at its start.
std::shared_ptr<TrainerMemory> FixedMemory(uint64_t bytes, const char* text = "") {
  const int fd = SharedFile(bytes, /*sealed=*/true, /*fixed=*/true);
  absl::StatusOr<std::shared_ptr<TrainerMemory>> memory =
      TrainerMemory::Map(fd, geteuid(), {}, /*keep_descriptor=*/true);
  close(fd);
  EXPECT_OK(memory);
  std::memcpy((*memory)->data(), text, std::strlen(text));
  return *memory;
}

// A child process that waits until killed: a trainer that is still running.
pid_t RunningChild() {
  const pid_t child = fork();
  if (child == 0) {
    while (true) pause();
  }
  EXPECT_GT(child, 0);
  return child;
}

void KillAndReap(pid_t child) {
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
}

TEST(TrainerMemoryTest, KeepsADescriptorOnlyWhenAskedForFixedSizeFilesOfAMebibyteOrMore) {
  std::shared_ptr<TrainerMemory> fixed = FixedMemory(kHandedOn);
  ASSERT_GE(fixed->kept_fd(), 0);
  struct stat info {};
  ASSERT_EQ(fstat(fixed->kept_fd(), &info), 0);
  EXPECT_EQ(static_cast<uint64_t>(info.st_size), kHandedOn);
  EXPECT_EQ(fixed->owner(), geteuid());
  EXPECT_EQ(FixedMemory(kHandedOn - 4096)->kept_fd(), -1);  // cheap to allocate again
  const int growable = SharedFile(kHandedOn, /*sealed=*/true);  // shrink-sealed only
  absl::StatusOr<std::shared_ptr<TrainerMemory>> memory =
      TrainerMemory::Map(growable, geteuid(), {}, /*keep_descriptor=*/true);
  close(growable);
  ASSERT_OK(memory);
  EXPECT_EQ((*memory)->kept_fd(), -1);
  const int fixed_file = SharedFile(kHandedOn, /*sealed=*/true, /*fixed=*/true);
  memory = TrainerMemory::Map(fixed_file, geteuid(), {});  // a daemon that keeps nothing
  close(fixed_file);
  ASSERT_OK(memory);
  EXPECT_EQ((*memory)->kept_fd(), -1);
}

TEST(TrainerSessionsTest, AnExitedTrainersFileGoesToItsRanksNextProcessOfTheSameUser) {
  TrainerSessions sessions(absl::Minutes(5));
  const TrainerSessions::Caller trainer{.uid = geteuid(), .pid = 4242};
  absl::StatusOr<TrainerSessions::Session> first = sessions.Start(3, trainer);
  ASSERT_OK(first);
  ASSERT_OK(sessions.Add(first->token, {FixedMemory(kHandedOn, "weights"), Memory()}));
  const pid_t child = RunningChild();
  ASSERT_OK(sessions.Bind(first->token, ProcessExit::Watch(child)));
  EXPECT_STATUS(sessions.Bind(first->token, ProcessExit::Watch(child)),
                absl::StatusCode::kFailedPrecondition);  // one memory connection per session
  std::optional<TrainerSessions::Ended> ended = sessions.End(first->token);
  ASSERT_TRUE(ended.has_value());
  EXPECT_EQ(ended->kept_bytes, kHandedOn);  // the small file is released
  EXPECT_EQ(sessions.retention().kept_files, 1u);
  EXPECT_EQ(sessions.retention().kept_bytes, kHandedOn);

  absl::StatusOr<TrainerSessions::Session> second = sessions.Start(3, trainer);
  ASSERT_OK(second);
  // While the process that handed it over runs, nobody gets its memory.
  absl::StatusOr<TrainerSessions::Adopted> adopted =
      sessions.Adopt(second->token, kHandedOn, geteuid(), kNoCopyInFlight);
  ASSERT_STATUS(adopted, absl::StatusCode::kNotFound);
  EXPECT_NE(adopted.status().message().find("has not exited"), std::string::npos)
      << adopted.status();
  KillAndReap(child);
  EXPECT_STATUS(sessions.Adopt(second->token, 2 * kHandedOn, geteuid(), kNoCopyInFlight),
                absl::StatusCode::kNotFound);  // not the size asked for
  EXPECT_STATUS(sessions.Adopt(second->token, kHandedOn, geteuid() + 1, kNoCopyInFlight),
                absl::StatusCode::kNotFound);  // another user's
  absl::StatusOr<TrainerSessions::Session> other_rank = sessions.Start(4, trainer);
  ASSERT_OK(other_rank);
  EXPECT_STATUS(sessions.Adopt(other_rank->token, kHandedOn, geteuid(), kNoCopyInFlight),
                absl::StatusCode::kNotFound);  // another rank's

  adopted = sessions.Adopt(second->token, kHandedOn, geteuid(), kNoCopyInFlight);
  ASSERT_OK(adopted);
  EXPECT_EQ(std::memcmp(adopted->memory->data(), "weights", 7), 0);  // the daemon's own mapping
  absl::StatusOr<std::shared_ptr<TrainerMemory>> found = sessions.Find(3, adopted->id);
  ASSERT_OK(found);
  EXPECT_EQ(found->get(), adopted->memory.get());
  void* trainer_view = mmap(nullptr, kHandedOn, PROT_READ, MAP_SHARED,
                            adopted->memory->kept_fd(), 0);
  ASSERT_NE(trainer_view, MAP_FAILED);
  EXPECT_EQ(std::memcmp(trainer_view, "weights", 7), 0);
  munmap(trainer_view, kHandedOn);
  EXPECT_STATUS(sessions.Adopt(second->token, kHandedOn, geteuid(), kNoCopyInFlight),
                absl::StatusCode::kNotFound);  // taken once
  EXPECT_EQ(sessions.retention().kept_files, 0u);
  EXPECT_EQ(sessions.retention().adopted_bytes_total, kHandedOn);
}

TEST(TrainerSessionsTest, KeptMemoryWaitsForCopiesInFlightAndIsReleasedWhenItsTimeIsOver) {
  TrainerSessions sessions(absl::Minutes(5));
  const TrainerSessions::Caller trainer{.uid = geteuid(), .pid = 4242};
  absl::StatusOr<TrainerSessions::Session> first = sessions.Start(3, trainer);
  ASSERT_OK(first);
  ASSERT_OK(sessions.Add(first->token, {FixedMemory(kHandedOn)}));
  const pid_t child = RunningChild();
  ASSERT_OK(sessions.Bind(first->token, ProcessExit::Watch(child)));
  KillAndReap(child);
  // A new Hello of the rank replaces the session before its connection is seen to close: the
  // memory is kept, but not handed on while that connection is open (a forked worker of the dead
  // process may hold it, and the memory with it).
  absl::StatusOr<TrainerSessions::Session> second = sessions.Start(3, trainer);
  ASSERT_OK(second);
  absl::StatusOr<TrainerSessions::Adopted> adopted =
      sessions.Adopt(second->token, kHandedOn, geteuid(), kNoCopyInFlight);
  ASSERT_STATUS(adopted, absl::StatusCode::kNotFound);
  EXPECT_NE(adopted.status().message().find("still open"), std::string::npos) << adopted.status();
  EXPECT_EQ(sessions.End(first->token), std::nullopt);  // the connection closes: no session ends
  adopted = sessions.Adopt(second->token, kHandedOn, geteuid(), /*copying=*/true);
  ASSERT_STATUS(adopted, absl::StatusCode::kNotFound);  // the earlier process's capture runs on
  EXPECT_NE(adopted.status().message().find("in flight"), std::string::npos) << adopted.status();

  const absl::Time now = absl::Now();
  EXPECT_LT(sessions.ReleaseExpired(now), now + absl::Minutes(6));
  EXPECT_EQ(sessions.retention().kept_files, 1u);
  EXPECT_EQ(sessions.ReleaseExpired(now + absl::Minutes(6)), absl::InfiniteFuture());
  EXPECT_EQ(sessions.retention().kept_files, 0u);
  EXPECT_STATUS(sessions.Adopt(second->token, kHandedOn, geteuid(), kNoCopyInFlight),
                absl::StatusCode::kNotFound);  // released
}

TEST(TrainerSessionsTest, NothingIsKeptWithoutARetentionOrAProcessToWatch) {
  const TrainerSessions::Caller trainer{.uid = geteuid(), .pid = 4242};
  TrainerSessions off;
  absl::StatusOr<TrainerSessions::Session> session = off.Start(3, trainer);
  ASSERT_OK(session);
  ASSERT_OK(off.Add(session->token, {FixedMemory(kHandedOn)}));
  const pid_t child = RunningChild();
  KillAndReap(child);
  ASSERT_OK(off.Bind(session->token, ProcessExit::Watch(child)));
  EXPECT_EQ(off.End(session->token)->kept_bytes, 0u);

  TrainerSessions on(absl::Minutes(5));
  session = on.Start(3, trainer);
  ASSERT_OK(session);
  ASSERT_OK(on.Add(session->token, {FixedMemory(kHandedOn)}));
  // A peer in another pid namespace (pid 0): its exit can never be known.
  ASSERT_OK(on.Bind(session->token, ProcessExit::Watch(0)));
  EXPECT_EQ(on.End(session->token)->kept_bytes, 0u);
  session = on.Start(3, trainer);  // and a session never watched
  ASSERT_OK(session);
  ASSERT_OK(on.Add(session->token, {FixedMemory(kHandedOn)}));
  EXPECT_EQ(on.End(session->token)->kept_bytes, 0u);
  EXPECT_EQ(on.retention().kept_files, 0u);
}

TEST(TrainerSessionsTest, ARankKeepsItsLargestFilesUntilItsNextProcessSnapshots) {
  TrainerSessions sessions(absl::Minutes(5));
  const TrainerSessions::Caller trainer{.uid = geteuid(), .pid = 4242};
  absl::StatusOr<TrainerSessions::Session> first = sessions.Start(3, trainer);
  ASSERT_OK(first);
  std::vector<std::shared_ptr<TrainerMemory>> files;
  for (size_t i = 0; i < TrainerSessions::kMaxKeptFilesPerRank + 2; ++i) {
    files.push_back(FixedMemory(kHandedOn + 4096 * i));
  }
  ASSERT_OK(sessions.Add(first->token, std::move(files)));
  const pid_t child = RunningChild();
  ASSERT_OK(sessions.Bind(first->token, ProcessExit::Watch(child)));
  KillAndReap(child);
  ASSERT_TRUE(sessions.End(first->token).has_value());
  EXPECT_EQ(sessions.retention().kept_files, TrainerSessions::kMaxKeptFilesPerRank);
  absl::StatusOr<TrainerSessions::Session> second = sessions.Start(3, trainer);
  ASSERT_OK(second);
  EXPECT_STATUS(sessions.Adopt(second->token, kHandedOn, geteuid(), kNoCopyInFlight),
                absl::StatusCode::kNotFound);  // among the smallest: not kept
  EXPECT_OK(sessions.Adopt(second->token, kHandedOn + 4096 * 5, geteuid(), kNoCopyInFlight));
  // The new process snapshots: it took what it needed, the rest expires now.
  sessions.ExpireKept(3);
  EXPECT_EQ(sessions.ReleaseExpired(absl::Now()), absl::InfiniteFuture());
  EXPECT_EQ(sessions.retention().kept_files, 0u);
}

// Kept memory stays within its bound: a trainer that exits makes room by releasing the memory
// kept longest, and a file larger than the bound is released at once.
TEST(TrainerSessionsTest, KeptMemoryStaysWithinItsBoundTheMemoryKeptLongestGoingFirst) {
  TrainerSessions sessions(absl::Minutes(5), TrainerSessions::kMemoryConnectionGrace,
                           2 * kHandedOn);
  const TrainerSessions::Caller trainer{.uid = geteuid(), .pid = 4242};
  const pid_t child = RunningChild();
  // A trainer of `rank` that handed over `bytes` exits: the bytes kept for its next process.
  auto exits = [&](uint32_t rank, uint64_t bytes) -> uint64_t {
    absl::StatusOr<TrainerSessions::Session> session = sessions.Start(rank, trainer);
    EXPECT_OK(session);
    EXPECT_OK(sessions.Add(session->token, {FixedMemory(bytes, "weights")}));
    EXPECT_OK(sessions.Bind(session->token, ProcessExit::Watch(child)));
    std::optional<TrainerSessions::Ended> ended = sessions.End(session->token);
    EXPECT_TRUE(ended.has_value());
    return ended ? ended->kept_bytes : 0;
  };
  EXPECT_EQ(exits(1, kHandedOn), kHandedOn);
  EXPECT_EQ(exits(2, kHandedOn), kHandedOn);
  EXPECT_EQ(sessions.retention().kept_bytes, 2 * kHandedOn);
  EXPECT_EQ(sessions.retention().bound_released_bytes_total, 0u);
  EXPECT_EQ(exits(3, kHandedOn), kHandedOn);  // rank 1's, kept longest, makes room
  EXPECT_EQ(sessions.retention().kept_bytes, 2 * kHandedOn);
  EXPECT_EQ(sessions.retention().bound_released_bytes_total, kHandedOn);
  EXPECT_EQ(exits(4, 3 * kHandedOn), 0u);  // larger than the bound: released at once
  EXPECT_EQ(sessions.retention().kept_bytes, 2 * kHandedOn);
  EXPECT_EQ(sessions.retention().bound_released_bytes_total, 4 * kHandedOn);
  KillAndReap(child);
  auto adopts = [&](uint32_t rank) {
    absl::StatusOr<TrainerSessions::Session> next = sessions.Start(rank, trainer);
    EXPECT_OK(next);
    return sessions.Adopt(next->token, kHandedOn, geteuid(), kNoCopyInFlight).ok();
  };
  EXPECT_FALSE(adopts(1));
  EXPECT_TRUE(adopts(2));
  EXPECT_TRUE(adopts(3));
}

TEST(TrainerSessionsTest, HellosThatNeverConnectTheirMemoryCannotFillTheDaemon) {
  // No grace: a session without its memory connection is not live at once.
  TrainerSessions sessions(absl::ZeroDuration(), absl::ZeroDuration());
  const TrainerSessions::Caller trainer{.uid = geteuid(), .pid = 4242};
  absl::StatusOr<TrainerSessions::Session> connected = sessions.Start(0, trainer);
  ASSERT_OK(connected);
  ASSERT_OK(sessions.Add(connected->token, {Memory()}));
  for (uint32_t rank = 1; rank < TrainerSessions::kMaxSessions; ++rank) {
    absl::StatusOr<TrainerSessions::Session> started = sessions.Start(rank, trainer);
    ASSERT_OK(started);
    EXPECT_TRUE(started->abandoned.empty());
  }
  // At the bound: the sessions that never connected their memory end, the connected one stays.
  absl::StatusOr<TrainerSessions::Session> next = sessions.Start(90000, trainer);
  ASSERT_OK(next);
  EXPECT_EQ(next->abandoned.size(), TrainerSessions::kMaxSessions - 1);
  for (const auto& [rank, number] : next->abandoned) EXPECT_NE(rank, 0u);
  EXPECT_OK(sessions.RankOf(connected->token));
  EXPECT_OK(sessions.RankOf(next->token));

  // Live sessions up to the bound: the next Hello is refused.
  TrainerSessions graceful(absl::ZeroDuration(), absl::Hours(1));
  for (uint32_t rank = 0; rank < TrainerSessions::kMaxSessions; ++rank) {
    ASSERT_OK(graceful.Start(rank, trainer));
  }
  EXPECT_STATUS(graceful.Start(90000, trainer), absl::StatusCode::kResourceExhausted);
  EXPECT_OK(graceful.Start(7, trainer));  // a rank's new process replaces its own session
}

TEST(ProcessExitTest, SaysExitedOnlyOnceTheProcessIsGone) {
  const pid_t child = RunningChild();
  const ProcessExit watch = ProcessExit::Watch(child);
  EXPECT_TRUE(watch.watching());
  EXPECT_FALSE(watch.Exited());
  kill(child, SIGKILL);
  // A killed child is a zombie until reaped: it runs no more code, and counts as exited.
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, child, &info, WEXITED | WNOWAIT), 0);  // dead, not reaped
  EXPECT_TRUE(watch.Exited());
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(watch.Exited());
  EXPECT_FALSE(ProcessExit::Watch(0).watching());
}

// A watch taken from a connection follows the process that connected, not whichever process has
// its pid: here the pid given is this test's own (as if the trainer's pid had been reused by a
// process that runs on), and the watch still says exited once the connected child is gone.
TEST(ProcessExitTest, AWatchFromAConnectionFollowsTheProcessThatConnected) {
  const int listener = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  // An abstract name, unique to this process: nothing to clean up on disk.
  const std::string name = "moesnap-process-exit-test-" + std::to_string(getpid());
  std::memcpy(address.sun_path + 1, name.data(), name.size());
  const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  ASSERT_EQ(bind(listener, reinterpret_cast<const sockaddr*>(&address), length), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  const pid_t child = fork();
  if (child == 0) {
    const int connection = socket(AF_UNIX, SOCK_STREAM, 0);
    if (connect(connection, reinterpret_cast<const sockaddr*>(&address), length) != 0) _exit(1);
    while (true) pause();
  }
  ASSERT_GT(child, 0);
  const int accepted = accept(listener, nullptr, nullptr);
  ASSERT_GE(accepted, 0);
  int pidfd = -1;
  socklen_t pidfd_length = sizeof(pidfd);
  if (getsockopt(accepted, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &pidfd_length) != 0) {
    KillAndReap(child);
    GTEST_SKIP() << "this kernel has no SO_PEERPIDFD (Linux 6.5): " << std::strerror(errno);
  }
  close(pidfd);
  const ProcessExit watch = ProcessExit::WatchPeer(accepted, getpid());
  EXPECT_TRUE(watch.watching());
  EXPECT_FALSE(watch.Exited());
  KillAndReap(child);
  EXPECT_TRUE(watch.Exited());
  EXPECT_FALSE(ProcessExit::WatchPeer(accepted, 0).watching());  // another pid namespace
  close(accepted);
  close(listener);
}

}  // namespace
}  // namespace moesnap::daemon
