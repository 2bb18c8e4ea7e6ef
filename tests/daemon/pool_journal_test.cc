// Pool allocation and the journal's crash consistency, in process (the crash tests do it for real).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/shared_memory.h"
#include "daemon/journal.h"
#include "daemon/pool.h"
#include "erasure/crc32c.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

std::string UniqueName(const std::string& what) {
  static int counter = 0;
  return absl::StrCat("moesnap-unit-", what, "-", getpid(), "-", counter++);
}

class PoolTest : public ::testing::Test {
 protected:
  void TearDown() override { SharedMemory::Unlink(options_.name + ".data").IgnoreError(); }
  static constexpr uint64_t kUnit = ExtentAllocator::kAlignment;
  PoolOptions options_{.name = UniqueName("pool"), .bytes = 64 * Pool::kPageBytes};
};

TEST_F(PoolTest, AllocatesFreesAndCoalesces) {
  absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(options_);
  ASSERT_OK(pool);
  EXPECT_FALSE((*pool)->reattached());
  const uint64_t capacity = options_.bytes;
  auto a = (*pool)->Allocate(10 * kUnit);
  auto b = (*pool)->Allocate(1);  // rounds up to the alignment
  auto c = (*pool)->Allocate(capacity - 11 * kUnit);
  ASSERT_OK(a);
  ASSERT_OK(b);
  ASSERT_OK(c);
  EXPECT_EQ((*pool)->free_bytes(), 0u);
  absl::StatusOr<std::shared_ptr<PoolExtent>> none = (*pool)->Allocate(1);
  ASSERT_STATUS(none, absl::StatusCode::kResourceExhausted);
  EXPECT_NE(none.status().message().find(absl::StrCat(kUnit, " more")), std::string::npos)
      << none.status();
  a->reset();
  c->reset();
  // a and c are not adjacent: one contiguous extent of everything but b does not fit ...
  EXPECT_STATUS((*pool)->Allocate(capacity - kUnit), absl::StatusCode::kResourceExhausted);
  // ... but the same bytes in pieces do, and hold what is written across them.
  absl::StatusOr<std::shared_ptr<PoolBytes>> pieces = (*pool)->AllocateBytes(capacity - kUnit);
  ASSERT_OK(pieces);
  EXPECT_EQ((*pieces)->pieces().size(), 2u);
  std::vector<uint8_t> written(capacity - kUnit);
  for (size_t i = 0; i < written.size(); ++i) written[i] = static_cast<uint8_t>(i * 31 + 7);
  (*pieces)->Write(0, written.data(), written.size());
  std::vector<uint8_t> read(written.size());
  (*pieces)->Read(0, read.size(), read.data());
  EXPECT_EQ(read, written);
  EXPECT_EQ((*pieces)->Crc32c(5, written.size() - 9), erasure::Crc32c(written.data() + 5, written.size() - 9));
  pieces->reset();
  b->reset();
  EXPECT_OK((*pool)->Allocate(capacity));
}

TEST_F(PoolTest, AReservationIsCutIntoVersionsAndWhatIsNotTakenGoesBack) {
  absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(options_);
  ASSERT_OK(pool);
  const uint64_t capacity = options_.bytes;
  // Two holes: the reservation takes both, and a version may straddle them.
  auto a = (*pool)->Allocate(capacity / 2);
  auto b = (*pool)->Allocate(kUnit);
  auto c = (*pool)->Allocate(capacity / 2 - kUnit);
  ASSERT_OK(a);
  ASSERT_OK(b);
  ASSERT_OK(c);
  a->reset();
  c->reset();
  EXPECT_STATUS((*pool)->Reserve(capacity), absl::StatusCode::kResourceExhausted);
  absl::StatusOr<std::shared_ptr<const PoolReservation>> reservation =
      (*pool)->Reserve(capacity - kUnit);
  ASSERT_OK(reservation);
  EXPECT_EQ((*pool)->free_bytes(), 0u);

  // Taken out of order, one of them across the two holes; [2 * kUnit, capacity / 4) is never taken.
  const uint64_t straddling = capacity / 2 - 3 * kUnit;
  std::shared_ptr<PoolBytes> across = (*reservation)->Take(straddling, 5 * kUnit + 1);
  std::shared_ptr<PoolBytes> first = (*reservation)->Take(0, 2 * kUnit);
  EXPECT_EQ(across->pieces().size(), 2u);
  EXPECT_EQ(PoolReservation::SpaceFor(5 * kUnit + 1), 6 * kUnit);
  std::vector<uint8_t> written(across->bytes());
  for (size_t i = 0; i < written.size(); ++i) written[i] = static_cast<uint8_t>(i * 13 + 1);
  across->Write(0, written.data(), written.size());
  std::vector<uint8_t> read(written.size());
  across->Read(0, read.size(), read.data());
  EXPECT_EQ(read, written);

  // The reservation gives back only the gaps between what was taken ...
  const uint64_t taken = 2 * kUnit + 6 * kUnit;
  reservation->reset();
  EXPECT_EQ((*pool)->free_bytes(), capacity - kUnit - taken);
  // ... and each version its own bytes.
  across.reset();
  first.reset();
  EXPECT_EQ((*pool)->free_bytes(), capacity - kUnit);
  b->reset();
  EXPECT_OK((*pool)->Allocate(capacity));
}

// A region's byte count comes from a trainer: near 2^64 it must not wrap to a small extent.
TEST_F(PoolTest, SizesNear2To64AreRefusedNeverWrapped) {
  absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(options_);
  ASSERT_OK(pool);
  for (const uint64_t bytes : {std::numeric_limits<uint64_t>::max(),
                               std::numeric_limits<uint64_t>::max() - kUnit + 2,
                               std::numeric_limits<uint64_t>::max() - 3}) {
    EXPECT_STATUS((*pool)->Allocate(bytes), absl::StatusCode::kResourceExhausted) << bytes;
    EXPECT_STATUS((*pool)->AllocateBytes(bytes), absl::StatusCode::kResourceExhausted) << bytes;
    EXPECT_STATUS((*pool)->Claim(0, bytes), absl::StatusCode::kDataLoss) << bytes;
  }
  EXPECT_EQ((*pool)->free_bytes(), options_.bytes);
}

TEST_F(PoolTest, ReattachesTheSameBytesAndRefusesAnotherSizeOrASecondOwner) {
  {
    absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(options_);
    ASSERT_OK(pool);
    absl::StatusOr<std::shared_ptr<PoolExtent>> extent = (*pool)->Allocate(4096);
    ASSERT_OK(extent);
    std::memset((*extent)->data(), 0x5a, 4096);
    EXPECT_STATUS(Pool::OpenOrCreate(options_), absl::StatusCode::kFailedPrecondition);
  }
  absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(options_);
  ASSERT_OK(pool);
  EXPECT_TRUE((*pool)->reattached());
  absl::StatusOr<std::shared_ptr<PoolExtent>> claimed = (*pool)->Claim(0, 4096);
  ASSERT_OK(claimed);
  EXPECT_EQ((*claimed)->data()[4095], 0x5a);
  EXPECT_STATUS((*pool)->Claim(0, 4096), absl::StatusCode::kDataLoss);
  claimed->reset();  // extents go before their pool
  pool->reset();
  PoolOptions bigger = options_;
  bigger.bytes *= 2;
  absl::StatusOr<std::unique_ptr<Pool>> resized = Pool::OpenOrCreate(bigger);
  ASSERT_STATUS(resized, absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(resized.status().message().find("pool.bytes"), std::string::npos);
}

class JournalTest : public ::testing::Test {
 protected:
  void TearDown() override { SharedMemory::Unlink(name_ + ".journal").IgnoreError(); }

  // A state's serialization, handed to the journal whole or in `pieces` pieces.
  static absl::Status Write(Journal& journal, const v1::JournalState& state, size_t pieces = 1) {
    const std::string bytes = state.SerializeAsString();
    std::vector<std::string_view> payload;
    for (size_t i = 0; i < pieces; ++i) {
      payload.push_back(std::string_view(bytes).substr(i * bytes.size() / pieces,
                                                       (i + 1) * bytes.size() / pieces -
                                                           i * bytes.size() / pieces));
    }
    return journal.Write(payload);
  }

  static v1::JournalState StateAtStep(int64_t step) {
    v1::JournalState state;
    v1::JournalVersion* version = state.add_versions();
    version->set_region("weights");
    version->set_step(step);
    version->set_bytes(100 * step);
    for (int i = 0; i < 1000; ++i) version->add_chunk_crcs(static_cast<uint32_t>(i * step));
    state.add_ranks()->set_latest_committed_step(step);
    return state;
  }

  std::string name_ = UniqueName("journal");
};

TEST_F(JournalTest, RecoversTheNewestWriteAfterReopen) {
  {
    auto journal = Journal::OpenOrCreate(name_, 1 << 20);
    ASSERT_OK(journal);
    EXPECT_EQ((*journal)->recovered_state().versions_size(), 0);
    for (int step = 1; step <= 5; ++step) {
      ASSERT_OK(Write(**journal, StateAtStep(step), /*pieces=*/step));
    }
  }
  auto journal = Journal::OpenOrCreate(name_, 1 << 20);
  ASSERT_OK(journal);
  EXPECT_EQ((*journal)->sequence(), 5);
  EXPECT_EQ((*journal)->recovered_state().SerializeAsString(), StateAtStep(5).SerializeAsString());
}

TEST_F(JournalTest, AProcessKilledMidWriteLeavesThePreviousStateReadable) {
  for (int64_t crash_at = 1; crash_at <= 4; ++crash_at) {
    SharedMemory::Unlink(name_ + ".journal").IgnoreError();
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      auto journal = Journal::OpenOrCreate(name_, 1 << 20);
      if (!journal.ok()) _exit(1);
      (*journal)->set_crash_in_write_for_testing(crash_at);
      for (int step = 1; step <= 10; ++step) {
        Write(**journal, StateAtStep(step), /*pieces=*/3).IgnoreError();
      }
      _exit(0);  // not reached: the write of sequence crash_at kills the process
    }
    int status = 0;
    waitpid(child, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "crash at " << crash_at;
    auto journal = Journal::OpenOrCreate(name_, 1 << 20);
    ASSERT_OK(journal);
    EXPECT_EQ((*journal)->sequence(), crash_at - 1);
    if (crash_at > 1) {
      EXPECT_EQ((*journal)->recovered_state().versions(0).step(), crash_at - 1);
      EXPECT_EQ((*journal)->recovered_state().versions(0).chunk_crcs_size(), 1000);
    }
  }
}

TEST_F(JournalTest, StateLargerThanASlotIsRefusedWithTheSizeNeeded) {
  auto journal = Journal::OpenOrCreate(name_, 64 * 1024);
  ASSERT_OK(journal);
  ASSERT_OK(Write(**journal, StateAtStep(1)));
  v1::JournalState huge = StateAtStep(2);
  for (int i = 0; i < 20000; ++i) huge.mutable_versions(0)->add_chunk_crcs(i);
  absl::Status status = Write(**journal, huge);
  ASSERT_STATUS(status, absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("pool.journal_bytes"), std::string::npos);
  EXPECT_EQ((*journal)->sequence(), 1);
}

// Room answers before a write as the write would: a journal of the size it names holds the state.
TEST_F(JournalTest, RoomForAStateNamesTheJournalSizeThatHoldsIt) {
  v1::JournalState huge = StateAtStep(2);
  for (int i = 0; i < 20000; ++i) huge.mutable_versions(0)->add_chunk_crcs(i);
  uint64_t needed = 0;
  {
    auto small = Journal::OpenOrCreate(name_, 64 * 1024);
    ASSERT_OK(small);
    const absl::Status room = (*small)->Room(huge.ByteSizeLong());
    ASSERT_STATUS(room, absl::StatusCode::kResourceExhausted);
    const std::string::size_type at = room.message().find("to at least ");
    ASSERT_NE(at, std::string::npos) << room;
    ASSERT_TRUE(absl::SimpleAtoi(room.message().substr(at + 12), &needed)) << room;
    EXPECT_OK((*small)->Room(1000));
  }
  ASSERT_OK(SharedMemory::Unlink(name_ + ".journal"));
  auto large = Journal::OpenOrCreate(name_, needed);
  ASSERT_OK(large);
  EXPECT_OK((*large)->Room(huge.ByteSizeLong()));
  EXPECT_OK(Write(**large, huge));
}

// An existing journal file smaller than any journal this daemon makes (cut short, or not its own)
// is refused, naming its size, before a byte of it is read as a slot: two slots of 20 bytes hold
// no 32-byte header, and a header read there claiming a gigabyte of payload must not be believed.
TEST_F(JournalTest, AnExistingFileTooSmallForTwoSlotsIsRefused) {
  {
    absl::StatusOr<SharedMemory> file =
        SharedMemory::Create(name_ + ".journal", 40, {.reserve = false});
    ASSERT_OK(file);
    // The start of a slot header: the journal's magic, sequence 1, a payload of 1 GiB.
    const uint64_t header[3] = {0x4c4e524a534d4f4dULL, 1, uint64_t{1} << 30};
    std::memcpy(file->data(), header, sizeof(header));
  }
  absl::StatusOr<std::unique_ptr<Journal>> journal = Journal::OpenOrCreate(name_, 1 << 20);
  ASSERT_STATUS(journal, absl::StatusCode::kDataLoss);
  EXPECT_NE(journal.status().message().find("40 bytes"), std::string::npos) << journal.status();
}

// The pool and journal hold every rank's state: created private to the daemon's user, and a file
// someone else put under their names first (to read the snapshots, or to feed the daemon forged
// ones) is refused, never adopted.
class OwnFilesTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const char* suffix : {".data", ".journal", ".target"}) {
      SharedMemory::Unlink(name_ + suffix).IgnoreError();
    }
  }
  std::string Path(const char* suffix) const { return "/dev/shm/" + name_ + suffix; }
  // Plants a file of the pool's size under `suffix`, with `mode`, owned by `uid`.
  void Plant(const char* suffix, mode_t mode, uid_t uid) {
    const int fd = open(Path(suffix).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, static_cast<off_t>(options_.bytes)), 0);
    ASSERT_EQ(fchmod(fd, mode), 0);
    ASSERT_EQ(fchown(fd, uid, static_cast<gid_t>(-1)), 0);
    close(fd);
  }
  void ExpectRefused(const std::string& mentions) {
    absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(options_);
    ASSERT_STATUS(pool, absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(pool.status().message().find(mentions), std::string::npos) << pool.status();
  }

  std::string name_ = UniqueName("own");
  PoolOptions options_{.name = name_, .bytes = 16 * Pool::kPageBytes};
};

TEST_F(OwnFilesTest, PoolAndJournalAreCreatedPrivateToTheDaemonsUser) {
  const mode_t old_umask = umask(0);  // a permissive umask must not open them up
  absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(options_);
  auto journal = Journal::OpenOrCreate(name_, 1 << 20);
  umask(old_umask);
  ASSERT_OK(pool);
  ASSERT_OK(journal);
  for (const char* suffix : {".data", ".journal"}) {
    struct stat info {};
    ASSERT_EQ(stat(Path(suffix).c_str(), &info), 0);
    EXPECT_EQ(info.st_mode & 07777, 0600u) << suffix;
    EXPECT_EQ(info.st_uid, geteuid()) << suffix;
  }
}

TEST_F(OwnFilesTest, AFileOfAnotherModeIsNotAdopted) {
  ASSERT_NO_FATAL_FAILURE(Plant(".data", 0640, geteuid()));
  ExpectRefused("mode 0640");
  ASSERT_NO_FATAL_FAILURE(Plant(".journal", 0666, geteuid()));
  EXPECT_STATUS(Journal::OpenOrCreate(name_, 1 << 20), absl::StatusCode::kFailedPrecondition);
}

TEST_F(OwnFilesTest, AFileOfAnotherUserIsNotAdopted) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  ASSERT_NO_FATAL_FAILURE(Plant(".data", 0600, 65534));
  ExpectRefused("owned by uid 65534");
  ASSERT_NO_FATAL_FAILURE(Plant(".journal", 0600, 65534));
  EXPECT_STATUS(Journal::OpenOrCreate(name_, 1 << 20), absl::StatusCode::kFailedPrecondition);
}

TEST_F(OwnFilesTest, ASymbolicLinkIsNotFollowed) {
  // The link points at a file the daemon could adopt: only the link itself is wrong.
  ASSERT_NO_FATAL_FAILURE(Plant(".target", 0600, geteuid()));
  ASSERT_EQ(symlink(Path(".target").c_str(), Path(".data").c_str()), 0);
  ExpectRefused("symbolic link");
}

}  // namespace
}  // namespace moesnap::daemon
