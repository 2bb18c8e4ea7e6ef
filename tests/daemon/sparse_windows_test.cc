// Sparse windows and the upstream log against a real moesnapd: a window commits only when all its
// slots have, survives a daemon SIGKILL through the journal, and bad slots are refused without
// touching it; the upstream log gives back the bytes logged, refuses what does not fit by name,
// and drops what is older than the last committed window.
#include <gtest/gtest.h>
#include <signal.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "moesnap/client.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_daemon.h"

namespace moesnap {
namespace {

using testing::TestDaemon;

constexpr size_t kRegionBytes = 4096;
constexpr int kWindow = 3;

void ExpectError(const absl::Status& status, absl::StatusCode code, const std::string& mentions) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), mentions))
      << "'" << status.message() << "' does not mention '" << mentions << "'";
}

std::string Payload(int64_t step, uint32_t micro_batch, size_t bytes = 1000) {
  std::string payload(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) payload[i] = static_cast<char>(step * 31 + micro_batch * 7 + i);
  return payload;
}

class SparseWindowsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(daemon_.Start());
    ASSERT_NO_FATAL_FAILURE(Connect());
  }

  // Rank 0 with regions "expert0@<buffer>" .. "expert2@<buffer>" for buffers 0 and 1.
  void Connect() {
    absl::StatusOr<std::unique_ptr<Client>> connected =
        Client::Connect({.socket_path = daemon_.agent_socket(), .rank = 0});
    ASSERT_OK(connected);
    client_ = *std::move(connected);
    absl::StatusOr<std::shared_ptr<SharedBuffer>> buffer = client_->AllocateHost(6 * kRegionBytes);
    ASSERT_OK(buffer);
    buffer_ = *buffer;
    for (int i = 0; i < 6; ++i) {
      ASSERT_OK(client_->RegisterHostRegion({Region(i % 3, i / 3), "uint8", {}}, buffer_,
                                            i * kRegionBytes, kRegionBytes));
    }
  }

  static std::string Region(int expert, uint32_t buffer) {
    return "expert" + std::to_string(expert) + "@" + std::to_string(buffer);
  }

  // Slot `step - first` of the window from `first`: expert k captured in slot k.
  absl::Status SnapshotSlot(int64_t step, int64_t first, uint32_t buffer) {
    const uint32_t slot = static_cast<uint32_t>(step - first);
    absl::StatusOr<uint64_t> bytes = client_->SnapshotSparse(
        step, {Region(static_cast<int>(slot), buffer)},
        {first, kWindow, slot, buffer, {"layer0.expert" + std::to_string(slot)}});
    if (!bytes.ok()) return bytes.status();
    return client_->WaitCommitted(step);
  }

  TestDaemon daemon_{{.pool_bytes = "64MiB",
                      .extra_config = "[upstream_log]\nmax_bytes = \"16KiB\"\n"}};
  std::unique_ptr<Client> client_;
  std::shared_ptr<SharedBuffer> buffer_;
};

TEST_F(SparseWindowsTest, AWindowCommitsWhenAllItsSlotsHaveAndSurvivesADaemonKill) {
  ASSERT_OK(SnapshotSlot(1, 1, 0));
  ASSERT_OK(SnapshotSlot(2, 1, 0));
  absl::StatusOr<SparseWindows> windows = client_->Windows();
  ASSERT_OK(windows);
  EXPECT_FALSE(windows->committed.has_value()) << "two of three slots committed";
  ASSERT_TRUE(windows->open.has_value());
  EXPECT_EQ(windows->open->slots.size(), 2u);

  ASSERT_OK(SnapshotSlot(3, 1, 0));
  ASSERT_OK(SnapshotSlot(4, 4, 1));  // the next window starts in the other buffer
  windows = client_->Windows();
  ASSERT_OK(windows);
  ASSERT_TRUE(windows->committed.has_value());
  EXPECT_EQ(windows->committed->first_step, 1);
  EXPECT_EQ(windows->committed->size, 3u);
  EXPECT_EQ(windows->committed->buffer, 0u);
  ASSERT_EQ(windows->committed->slots.size(), 3u);
  for (uint32_t slot = 0; slot < 3; ++slot) {
    EXPECT_EQ(windows->committed->slots[slot].step, 1 + slot);
    EXPECT_TRUE(windows->committed->slots[slot].committed);
    EXPECT_EQ(windows->committed->slots[slot].operators,
              std::vector<std::string>{"layer0.expert" + std::to_string(slot)});
  }
  ASSERT_TRUE(windows->open.has_value());
  EXPECT_EQ(windows->open->first_step, 4);
  EXPECT_EQ(windows->open->buffer, 1u);

  client_.reset();  // the trainer goes with its daemon
  daemon_.Kill(SIGKILL);
  ASSERT_TRUE(daemon_.Start());
  ASSERT_NO_FATAL_FAILURE(Connect());
  absl::StatusOr<SparseWindows> recovered = client_->Windows();
  ASSERT_OK(recovered);
  ASSERT_TRUE(recovered->committed.has_value());
  EXPECT_EQ(recovered->committed->first_step, 1);
  EXPECT_EQ(recovered->committed->slots.size(), 3u);
  ASSERT_TRUE(recovered->open.has_value());
  EXPECT_EQ(recovered->open->first_step, 4);
  EXPECT_EQ(recovered->open->slots.size(), 1u);
  // The replacement trainer continues the open window where it stopped.
  ASSERT_OK(SnapshotSlot(5, 4, 1));
}

TEST_F(SparseWindowsTest, SlotsOutOfOrderAreRefusedAndTheCommittedWindowStays) {
  for (int64_t step = 1; step <= 3; ++step) ASSERT_OK(SnapshotSlot(step, 1, 0));
  ExpectError(SnapshotSlot(5, 4, 1), absl::StatusCode::kFailedPrecondition,
              "a window starts with its slot 0");
  ExpectError(SnapshotSlot(4, 4, 0), absl::StatusCode::kFailedPrecondition,
              "buffer 0 holds the last committed window (from step 1)");
  ExpectError(client_->SnapshotSparse(4, {Region(0, 1)}, {4, kWindow, 3, 1, {}}).status(),
              absl::StatusCode::kInvalidArgument, "has no such slot");
  ExpectError(client_->SnapshotSparse(4, {Region(0, 1)}, {1, kWindow, 1, 1, {}}).status(),
              absl::StatusCode::kInvalidArgument, "slot 1 of that window is step 2");
  ASSERT_OK(SnapshotSlot(4, 4, 1));
  ExpectError(client_->SnapshotSparse(6, {Region(2, 1)}, {4, kWindow, 2, 1, {}}).status(),
              absl::StatusCode::kFailedPrecondition, "the window's next slot is 1");
  ExpectError(client_->SnapshotSparse(5, {Region(1, 0)}, {4, kWindow, 1, 0, {}}).status(),
              absl::StatusCode::kFailedPrecondition, "buffer 1");
  absl::StatusOr<SparseWindows> windows = client_->Windows();
  ASSERT_OK(windows);
  ASSERT_TRUE(windows->committed.has_value());
  EXPECT_EQ(windows->committed->first_step, 1);
  EXPECT_EQ(windows->committed->slots.size(), 3u);
}

TEST_F(SparseWindowsTest, ANewTrainerProcessMayReplayStepsItsPredecessorSnapshotted) {
  for (int64_t step = 1; step <= 2; ++step) ASSERT_OK(SnapshotSlot(step, 1, 0));
  // The same process may not go back ...
  ExpectError(client_->SnapshotSparse(2, {Region(1, 0)}, {1, kWindow, 1, 0, {}}).status(),
              absl::StatusCode::kInvalidArgument, "is not after step 2");
  // ... a replacement replaying the step finds it stored: nothing to copy, and the window goes on.
  client_.reset();
  ASSERT_NO_FATAL_FAILURE(Connect());
  absl::StatusOr<uint64_t> replayed =
      client_->SnapshotSparse(2, {Region(1, 0)}, {1, kWindow, 1, 0, {"layer0.expert1"}});
  ASSERT_OK(replayed);
  EXPECT_EQ(*replayed, 0u);
  ASSERT_OK(SnapshotSlot(3, 1, 0));
  absl::StatusOr<SparseWindows> windows = client_->Windows();
  ASSERT_OK(windows);
  ASSERT_TRUE(windows->committed.has_value());
  EXPECT_EQ(windows->committed->slots.size(), 3u);
}

TEST_F(SparseWindowsTest, TheUpstreamLogGivesBackWhatWasLoggedAndRefusesConflicts) {
  for (uint32_t micro_batch = 0; micro_batch < 3; ++micro_batch) {
    ASSERT_OK(client_->AppendLog(2, micro_batch, LogDirection::kForward, 1, Payload(2, micro_batch)));
  }
  ASSERT_OK(client_->AppendLog(2, 0, LogDirection::kBackward, 3, Payload(9, 9)));
  // A replay logging the same message again is accepted once.
  ASSERT_OK(client_->AppendLog(2, 1, LogDirection::kForward, 1, Payload(2, 1)));
  ExpectError(client_->AppendLog(2, 1, LogDirection::kForward, 1, Payload(2, 2)),
              absl::StatusCode::kFailedPrecondition, "not deterministic");

  absl::StatusOr<std::vector<LoggedMessage>> fetched =
      client_->FetchLog(0, 2, LogDirection::kForward, 1);
  ASSERT_OK(fetched);
  ASSERT_EQ(fetched->size(), 3u);
  for (uint32_t micro_batch = 0; micro_batch < 3; ++micro_batch) {
    EXPECT_EQ((*fetched)[micro_batch].micro_batch, micro_batch);
    EXPECT_EQ((*fetched)[micro_batch].payload, Payload(2, micro_batch));
  }
  fetched = client_->FetchLog(0, 2, LogDirection::kBackward, 3);
  ASSERT_OK(fetched);
  ASSERT_EQ(fetched->size(), 1u);
  EXPECT_EQ((*fetched)[0].payload, Payload(9, 9));
  ExpectError(client_->FetchLog(7, 2, LogDirection::kForward, 1).status(),
              absl::StatusCode::kNotFound, "no upstream log of rank 7");
}

TEST_F(SparseWindowsTest, AFullLogIsAClearErrorAndACommittedWindowFreesIt) {
  // 16 KiB hold 14 records of 1000 bytes (with bookkeeping); step 10 does not fit.
  int64_t step = 2;
  absl::Status appended;
  for (; step < 40 && appended.ok(); ++step) {
    appended = client_->AppendLog(step, 0, LogDirection::kForward, 1, Payload(step, 0));
  }
  const int64_t refused = step - 1;
  ExpectError(appended, absl::StatusCode::kResourceExhausted, "upstream_log.max_bytes");
  ExpectError(client_->FetchLog(0, refused, LogDirection::kForward, 1).status(),
              absl::StatusCode::kDataLoss, "the upstream log was full");
  absl::StatusOr<std::vector<LoggedMessage>> kept = client_->FetchLog(0, 3, LogDirection::kForward, 1);
  ASSERT_OK(kept);
  ASSERT_EQ(kept->size(), 1u);
  EXPECT_EQ((*kept)[0].payload, Payload(3, 0));

  // Windows from step 1 and 4 commit: a recovery starts at step 4 at the earliest.
  for (int64_t s = 1; s <= 3; ++s) ASSERT_OK(SnapshotSlot(s, 1, 0));
  for (int64_t s = 4; s <= 6; ++s) ASSERT_OK(SnapshotSlot(s, 4, 1));
  ASSERT_OK(client_->AppendLog(refused + 1, 0, LogDirection::kForward, 1, Payload(refused + 1, 0)));
  ExpectError(client_->FetchLog(0, 3, LogDirection::kForward, 1).status(),
              absl::StatusCode::kOutOfRange, "older than the last committed window");
  kept = client_->FetchLog(0, 5, LogDirection::kForward, 1);
  ASSERT_OK(kept);
  ASSERT_EQ(kept->size(), 1u);
  EXPECT_EQ((*kept)[0].payload, Payload(5, 0));
}

}  // namespace
}  // namespace moesnap
