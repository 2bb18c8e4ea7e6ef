// The store in process, with real pool, journal and host copies of memfd trainer memory: what it
// decides when commits lag, when the pool is full or fragmented, when a rank restores, and when a
// trainer process goes away.
#include "daemon/store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <span>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/shared_memory.h"
#include "daemon/shard_layout.h"
#include "erasure/crc32c.h"
#include "proto/restored_regions.h"
#include "tests/testing/deterministic_bytes.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

constexpr uint64_t kRegionBytes = 256 * 1024;

// Host copies that wait, before copying out (or in), until the test lets them run: a copy as slow
// as the test needs.
class HeldCopyBackend : public CopyBackend {
 public:
  explicit HeldCopyBackend(std::unique_ptr<CopyBackend> inner) : inner_(std::move(inner)) {}

  void Release() { released_.Notify(); }
  void ReleaseCopiesIn() { copies_in_released_.Notify(); }
  // From now on a registration's regions open only once ReleaseOpens is called (after it, once an
  // open waits: AwaitOpen).
  void HoldOpens() { hold_opens_ = true; }
  void AwaitOpen() { open_waits_.WaitForNotification(); }
  void ReleaseOpens() { opens_released_.Notify(); }
  // Returns once a copy into trainer memory waits.
  void AwaitCopyIn() { copy_in_waits_.WaitForNotification(); }

  std::string name() const override { return inner_->name(); }
  bool supports_device_memory() const override { return inner_->supports_device_memory(); }
  absl::Status PinHostMemory(void* data, uint64_t bytes) override {
    return inner_->PinHostMemory(data, bytes);
  }
  absl::StatusOr<std::shared_ptr<RegionSource>> Open(uint32_t rank,
                                                     const v1::RegionSpec& spec) override {
    absl::StatusOr<std::shared_ptr<RegionSource>> opened = inner_->Open(rank, spec);
    if (hold_opens_) {
      if (!open_seen_.exchange(true)) open_waits_.Notify();
      opens_released_.WaitForNotification();
    }
    return opened;
  }
  absl::StatusOr<uint32_t> CopyOut(RegionSource& source, uint64_t offset, uint8_t* destination,
                                   uint64_t bytes, uint32_t crc) override {
    released_.WaitForNotification();
    return inner_->CopyOut(source, offset, destination, bytes, crc);
  }
  absl::StatusOr<uint32_t> CopyIn(RegionSource& source, uint64_t offset, const uint8_t* origin,
                                  uint64_t bytes, uint32_t crc) override {
    if (!copy_in_seen_.exchange(true)) copy_in_waits_.Notify();
    copies_in_released_.WaitForNotification();
    return inner_->CopyIn(source, offset, origin, bytes, crc);
  }

 private:
  const std::unique_ptr<CopyBackend> inner_;
  absl::Notification released_;
  absl::Notification copies_in_released_;
  absl::Notification copy_in_waits_;
  std::atomic<bool> copy_in_seen_ = false;
  std::atomic<bool> hold_opens_ = false;
  absl::Notification open_waits_;
  absl::Notification opens_released_;
  std::atomic<bool> open_seen_ = false;
};

// Host copies that record the batches the store hands over, and can fail them.
class BatchRecordingBackend : public CopyBackend {
 public:
  explicit BatchRecordingBackend(std::unique_ptr<CopyBackend> inner) : inner_(std::move(inner)) {}

  std::vector<size_t> out_batches() {
    absl::MutexLock lock(&mutex_);
    return out_batches_;
  }
  std::vector<size_t> in_batches() {
    absl::MutexLock lock(&mutex_);
    return in_batches_;
  }
  void FailCopiesOut() { fail_out_ = true; }
  void FailCopiesIn() { fail_in_ = true; }

  std::string name() const override { return inner_->name(); }
  bool supports_device_memory() const override { return false; }
  absl::Status PinHostMemory(void* data, uint64_t bytes) override {
    return inner_->PinHostMemory(data, bytes);
  }
  absl::StatusOr<std::shared_ptr<RegionSource>> Open(uint32_t rank,
                                                     const v1::RegionSpec& spec) override {
    return inner_->Open(rank, spec);
  }
  absl::StatusOr<uint32_t> CopyOut(RegionSource& source, uint64_t offset, uint8_t* destination,
                                   uint64_t bytes, uint32_t crc) override {
    return inner_->CopyOut(source, offset, destination, bytes, crc);
  }
  absl::StatusOr<uint32_t> CopyIn(RegionSource& source, uint64_t offset, const uint8_t* origin,
                                  uint64_t bytes, uint32_t crc) override {
    return inner_->CopyIn(source, offset, origin, bytes, crc);
  }
  absl::Status CopyOutBatch(std::span<Transfer> transfers) override {
    {
      absl::MutexLock lock(&mutex_);
      out_batches_.push_back(transfers.size());
    }
    if (fail_out_) return absl::InternalError("injected copy failure");
    return CopyBackend::CopyOutBatch(transfers);
  }
  absl::Status CopyInBatch(std::span<Transfer> transfers) override {
    {
      absl::MutexLock lock(&mutex_);
      in_batches_.push_back(transfers.size());
    }
    if (fail_in_) return absl::InternalError("injected copy failure");
    return CopyBackend::CopyInBatch(transfers);
  }

 private:
  const std::unique_ptr<CopyBackend> inner_;
  std::atomic<bool> fail_out_ = false;
  std::atomic<bool> fail_in_ = false;
  absl::Mutex mutex_;
  std::vector<size_t> out_batches_ ABSL_GUARDED_BY(mutex_);
  std::vector<size_t> in_batches_ ABSL_GUARDED_BY(mutex_);
};

class StoreTest : public ::testing::Test {
 protected:
  void TearDown() override {
    store_.reset();
    journal_.reset();
    pool_.reset();
    SharedMemory::Unlink(name_ + ".data").IgnoreError();
    SharedMemory::Unlink(name_ + ".journal").IgnoreError();
    for (const auto& [rank, trainer] : trainers_) munmap(trainer.data, trainer.bytes);
  }

  void Open(CommitMode mode, uint64_t pool_bytes = 4 << 20, CaptureOptions options = {},
            uint64_t journal_bytes = 1 << 20) {
    absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(
        {.name = name_, .bytes = pool_bytes, .lock = PoolLockMode::kOff});
    ASSERT_OK(pool);
    pool_ = *std::move(pool);
    absl::StatusOr<std::unique_ptr<Journal>> journal =
        Journal::OpenOrCreate(name_, journal_bytes);
    ASSERT_OK(journal);
    journal_ = *std::move(journal);
    options.chunk_bytes = 64 * 1024;
    absl::StatusOr<std::unique_ptr<Store>> store =
        Store::Open(pool_.get(), journal_.get(), {backend_.get(), nullptr}, options, mode);
    ASSERT_OK(store);
    store_ = *std::move(store);
  }

  // Copies from now on wait until the test lets them run (before Open).
  HeldCopyBackend* HoldCopies() {
    auto held = std::make_unique<HeldCopyBackend>(std::move(backend_));
    HeldCopyBackend* copies = held.get();
    backend_ = std::move(held);
    return copies;
  }

  // A trainer process of `rank` holding `regions` regions of kRegionBytes in one memfd, registered.
  void Connect(uint32_t rank, int regions = 2, uint64_t region_bytes = kRegionBytes) {
    ConnectSized(rank, std::vector<uint64_t>(regions, region_bytes));
  }

  // A region's dtype and shape as a trainer declares them.
  struct DeclaredType {
    std::string dtype;
    std::vector<int64_t> shape;
  };

  // The same with regions of the given sizes (region0, region1, ...), all of them in replica group
  // `group` when it names one, region i declared of types[i] where given.
  void ConnectSized(uint32_t rank, const std::vector<uint64_t>& sizes,
                    const v1::ReplicaGroup& group = {},
                    const std::vector<DeclaredType>& types = {}) {
    absl::StatusOr<TrainerSessions::Session> started =
        sessions_.Start(rank, {.uid = geteuid(), .pid = getpid()});
    ASSERT_OK(started);
    const TrainerSessions::Session session = *started;
    uint64_t bytes = 0;
    for (uint64_t size : sizes) bytes += size;
    const int fd = memfd_create("store-test", MFD_CLOEXEC);
    ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
    auto* data = static_cast<uint8_t*>(
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    absl::StatusOr<std::shared_ptr<TrainerMemory>> memory = TrainerMemory::Map(fd, geteuid(), {});
    close(fd);
    ASSERT_OK(memory);
    absl::StatusOr<uint64_t> id = sessions_.Add(session.token, {*memory});
    ASSERT_OK(id);
    ASSERT_OK(store_->StartSession(rank, session.number));
    std::vector<v1::RegionSpec> specs;
    uint64_t offset = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      v1::RegionSpec spec;
      spec.set_name(absl::StrCat("region", i));
      spec.set_device(v1::DEVICE_HOST);
      spec.set_bytes(sizes[i]);
      spec.mutable_handle()->set_memory(*id);
      spec.mutable_handle()->set_shm_offset(offset);
      if (!group.name().empty()) *spec.mutable_replica_group() = group;
      if (i < types.size()) {
        spec.set_dtype(types[i].dtype);
        spec.mutable_shape()->Add(types[i].shape.begin(), types[i].shape.end());
      }
      specs.push_back(spec);
      offset += sizes[i];
    }
    ASSERT_OK(store_->RegisterRegions(rank, specs));
    if (auto old = trainers_.find(rank); old != trainers_.end()) {
      munmap(old->second.data, old->second.bytes);
    }
    trainers_[rank] = {data, bytes, session.number, *id};
  }

  // Fills `rank`'s memory with bytes drawn from `seed`, commits them as step 1, and returns them.
  std::vector<uint8_t> CommitRandomBytes(uint32_t rank, uint64_t seed) {
    Trainer& trainer = trainers_.at(rank);
    moesnap::testing::DeterministicBytes(seed).Fill(trainer.data, trainer.bytes);
    EXPECT_OK(store_->Snapshot(rank, 1, {}));
    EXPECT_OK(
        store_->WaitCommitted(rank, 1, absl::Now() + absl::Seconds(30), [] { return false; }));
    return std::vector<uint8_t>(trainer.data, trainer.data + trainer.bytes);
  }

  // A whole restore of `rank`, into zeroed memory, fails with DATA_LOSS naming `damaged` ("region
  // 'r' of rank R, step S, chunk C").
  void ExpectRestoreFindsDamage(uint32_t rank, const std::string& damaged) {
    Trainer& trainer = trainers_.at(rank);
    std::memset(trainer.data, 0, trainer.bytes);
    absl::StatusOr<v1::RestoreResponse> restored =
        store_->Restore(rank, std::nullopt, {}, absl::Now() + absl::Seconds(30));
    EXPECT_STATUS(restored, absl::StatusCode::kDataLoss);
    EXPECT_TRUE(absl::StrContains(restored.status().message(), damaged)) << restored.status();
  }

  // The trainer's bytes for `step`, then its snapshot.
  v1::SnapshotResponse Take(uint32_t rank, int64_t step) {
    Trainer& trainer = trainers_.at(rank);
    std::memset(trainer.data, static_cast<int>(step), trainer.bytes);
    absl::StatusOr<v1::SnapshotResponse> taken = store_->Snapshot(rank, step, {});
    EXPECT_OK(taken);
    return taken.value_or(v1::SnapshotResponse());
  }

  absl::StatusOr<v1::StepState> WaitCaptured(uint32_t rank, int64_t step) {
    return store_->WaitCaptured(rank, step, absl::Now() + absl::Seconds(30), [] { return false; });
  }

  // Two ranks of a cluster node commit step 1; rank 0 takes step 2 and rank 1 turns idle, so the
  // node offers step 2 without it: `offered`, the image it offered.
  void OfferStepTwoWithoutRankOne(NodeImage* offered) {
    ASSERT_NO_FATAL_FAILURE(OpenTwoRanksInCluster(absl::Milliseconds(300)));
    Take(0, 1);
    Take(1, 1);
    ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
    Take(0, 2);
    absl::StatusOr<NodeImage> image = store_->WaitNodeCaptured(2, absl::Now() + absl::Seconds(30));
    ASSERT_OK(image);
    ASSERT_TRUE(Dropped().contains(1));
    *offered = *std::move(image);
  }

  // The ranks left out of the node's steps, with why.
  std::map<uint32_t, std::string> Dropped() const {
    std::map<uint32_t, std::string> dropped;
    const v1::StatusResponse status = store_->Status();
    for (const v1::DroppedRank& rank : status.dropped_ranks()) {
      dropped[rank.rank()] = rank.reason();
    }
    return dropped;
  }

  // The record of a group of three nodes whose images are all `image` at `step`, with a parity
  // record for each of `stripes` stripes, each record's numbers as wide as they come.
  static v1::JournalCluster GroupRecord(const NodeImage& image, int64_t step, uint64_t stripes) {
    v1::JournalCluster record;
    record.set_committed_step(step);
    for (uint32_t node = 0; node < 3; ++node) {
      v1::NodeImage& member = *record.add_group_images();
      member = image.manifest();
      member.set_node_id(node);
      member.set_step(step);
    }
    for (uint64_t stripe = 0; stripe < stripes; ++stripe) {
      v1::JournalParity* parity = record.add_parity();
      parity->set_stripe(std::numeric_limits<uint64_t>::max() - stripe);
      parity->set_pool_offset(std::numeric_limits<uint64_t>::max());
      parity->set_bytes(std::numeric_limits<uint64_t>::max());
      parity->set_crc(0xffffffff);
    }
    return record;
  }

  // A node of a cluster with ranks 0 and 1 connected, each left out of the node's steps once idle
  // for `idle_rank_timeout`.
  void OpenTwoRanksInCluster(absl::Duration idle_rank_timeout) {
    CaptureOptions options;
    options.idle_rank_timeout = idle_rank_timeout;
    ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 4 << 20, options));
    ASSERT_NO_FATAL_FAILURE(Connect(0));
    ASSERT_NO_FATAL_FAILURE(Connect(1));
  }

  // Waits until `step` is captured on the node and commits it, as the cluster would.
  void CommitInCluster(int64_t step) {
    ASSERT_OK(store_->WaitNodeCaptured(step, absl::Now() + absl::Seconds(30)));
    v1::JournalCluster record;
    record.set_committed_step(step);
    ASSERT_OK(store_->CommitNodeStep(step, record, {}));
  }

  // A store in cluster mode whose ranks 0 and 1 took step 1, committed.
  void CommitTwoRanksInCluster() {
    ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
    ASSERT_NO_FATAL_FAILURE(Connect(0));
    ASSERT_NO_FATAL_FAILURE(Connect(1));
    Take(0, 1);
    Take(1, 1);
    ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  }

  struct Trainer {
    uint8_t* data = nullptr;
    uint64_t bytes = 0;
    uint64_t session = 0;
    uint64_t memory = 0;  // the handle of its memfd
  };

  std::string name_ = absl::StrCat("moesnap-store-test-", getpid(), "-",
                                   ::testing::UnitTest::GetInstance()->random_seed());
  TrainerSessions sessions_;
  std::unique_ptr<CopyBackend> backend_ = CreateHostCopyBackend(&sessions_);
  std::unique_ptr<Pool> pool_;
  std::unique_ptr<Journal> journal_;
  std::unique_ptr<Store> store_;
  std::map<uint32_t, Trainer> trainers_;
};

// The bound a node checks before it encodes a step holds the state its commit then writes: 300
// small regions, the group's record three images of them and a parity record per stripe, each
// record's numbers as wide as they come.
TEST_F(StoreTest, TheJournalBoundCheckedBeforeAnEncodeHoldsTheStateTheCommitWrites) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 16 << 20));
  ASSERT_NO_FATAL_FAILURE(Connect(0, 300, 1000));
  EXPECT_TRUE(Take(0, 1).skipped().empty());
  absl::StatusOr<NodeImage> image = store_->WaitNodeCaptured(1, absl::Now() + absl::Seconds(30));
  ASSERT_OK(image);
  constexpr uint64_t kStripes = 40;
  const v1::JournalCluster record = GroupRecord(*image, 1, kStripes);
  const std::vector<std::string> group = SerializedImages(record);
  // The image counted its regions' pool extents as it was made.
  uint64_t extents = 0;
  for (const std::shared_ptr<PoolBytes>& stored : image->stored()) {
    extents += stored->extents().size();
  }
  EXPECT_EQ(image->pool_extents(), extents);
  // This node's image is the first of the group's.
  const absl::StatusOr<uint64_t> bound = CommitJournalBound(*image, 0, group, kStripes);
  ASSERT_OK(bound);
  ASSERT_OK(store_->JournalRoomFor(*image, 0, group, kStripes));
  EXPECT_STATUS(store_->JournalRoomFor(*image, 3, group, kStripes),
                absl::StatusCode::kInvalidArgument);
  ASSERT_OK(store_->CommitNodeStep(1, record, group));
  absl::StatusOr<std::unique_ptr<Journal>> written = Journal::OpenOrCreate(name_, 1 << 20);
  ASSERT_OK(written);
  const uint64_t state_bytes = (*written)->recovered_state().ByteSizeLong();
  EXPECT_EQ((*written)->recovered_state().cluster().committed_step(), 1);
  EXPECT_LE(state_bytes, *bound);
  EXPECT_GT(state_bytes, *bound / 2) << "a bound this loose refuses journals that would hold it";
}

// The journal writes a group record's images as the serialized bytes the commit hands it: a
// restarted daemon reads back the record it committed, field for field, and a later write keeps
// it. Bytes that are not one per image are refused before anything is written.
TEST_F(StoreTest, AGroupRecordCommittedWithItsImagesBytesIsReadBackWhole) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 16 << 20));
  ASSERT_NO_FATAL_FAILURE(Connect(0, 300, 1000));
  EXPECT_TRUE(Take(0, 1).skipped().empty());
  v1::JournalCluster record;
  {
    // The image holds its pool bytes: it goes before the pool does.
    absl::StatusOr<NodeImage> image =
        store_->WaitNodeCaptured(1, absl::Now() + absl::Seconds(30));
    ASSERT_OK(image);
    record = GroupRecord(*image, 1, 7);
  }
  std::vector<std::string> too_few = SerializedImages(record);
  too_few.pop_back();
  const int64_t sequence = journal_->sequence();
  EXPECT_STATUS(store_->CommitNodeStep(1, record, too_few), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(journal_->sequence(), sequence);
  absl::StatusOr<std::shared_ptr<const v1::JournalCluster>> installed =
      store_->CommitNodeStep(1, record, SerializedImages(record));
  ASSERT_OK(installed);
  EXPECT_EQ(*installed, store_->ClusterRecord()) << "the record committed is the one held";
  auto same = [](const v1::JournalCluster& a, const v1::JournalCluster& b) {
    return a.SerializeAsString() == b.SerializeAsString();
  };
  EXPECT_TRUE(same(journal_->recovered_state().cluster(), v1::JournalCluster()));
  // Restarted on a single node, the daemon commits a step of its own: that journal write keeps
  // the record, its images written from the bytes the restarted store made of the journal's.
  int64_t latest = 1;
  for (CommitMode mode : {CommitMode::kLocal, CommitMode::kCluster}) {
    store_.reset();
    journal_.reset();
    pool_.reset();
    ASSERT_NO_FATAL_FAILURE(Open(mode, 16 << 20));
    EXPECT_TRUE(same(journal_->recovered_state().cluster(), record)) << "after step " << latest;
    EXPECT_TRUE(same(*store_->ClusterRecord(), record)) << "after step " << latest;
    EXPECT_EQ(store_->LatestCommitted(0), latest);
    if (mode == CommitMode::kLocal) {
      ASSERT_NO_FATAL_FAILURE(Connect(0, 300, 1000));
      EXPECT_TRUE(Take(0, 2).skipped().empty());
      ASSERT_OK(
          store_->WaitCommitted(0, 2, absl::Now() + absl::Seconds(30), [] { return false; }));
      latest = 2;
    }
  }
}

// A journal entry whose chunks or piece do not describe its region (damaged, or not written by
// this daemon) is not used: the store does not open, naming the entry and what is wrong, as it
// does for an entry whose pool extents are wrong. Taken, each would have made a restore loop until
// memory ran out (chunks of 0 bytes), read past the entry's CRCs, or write past the trainer's
// region.
TEST_F(StoreTest, AJournalEntryWhoseChunksOrPieceDoNotDescribeItsRegionIsNotUsed) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal));
  ASSERT_NO_FATAL_FAILURE(Connect(0, 1));
  const std::vector<uint8_t> committed = CommitRandomBytes(0, 11);
  store_.reset();
  journal_.reset();
  pool_.reset();
  v1::JournalState written;
  {
    absl::StatusOr<std::unique_ptr<Journal>> journal = Journal::OpenOrCreate(name_, 1 << 20);
    ASSERT_OK(journal);
    written = (*journal)->recovered_state();
  }
  ASSERT_EQ(written.versions_size(), 1);
  auto rewrite = [&](const v1::JournalState& state) {
    absl::StatusOr<std::unique_ptr<Journal>> journal = Journal::OpenOrCreate(name_, 1 << 20);
    ASSERT_OK(journal);
    const std::string bytes = state.SerializeAsString();
    ASSERT_OK((*journal)->Write({std::string_view(bytes)}));
  };
  struct Damage {
    std::string what;
    std::function<void(v1::JournalVersion&)> apply;
  };
  const std::vector<Damage> damages = {
      {"chunk size is 0", [](v1::JournalVersion& entry) { entry.set_chunk_bytes(0); }},
      {"lists 3 chunk CRCs",
       [](v1::JournalVersion& entry) { entry.mutable_chunk_crcs()->RemoveLast(); }},
      {"past the region's end",
       [](v1::JournalVersion& entry) {
         v1::RegionPiece& piece = *entry.mutable_piece();
         piece.set_replica_group("data-parallel");
         piece.set_offset(std::numeric_limits<uint64_t>::max() - 4096);
         piece.set_region_bytes(entry.bytes());
       }},
      {"names no replica group",
       [](v1::JournalVersion& entry) { entry.mutable_piece()->set_offset(1 << 20); }},
  };
  for (const Damage& damage : damages) {
    v1::JournalState damaged = written;
    damage.apply(*damaged.mutable_versions(0));
    ASSERT_NO_FATAL_FAILURE(rewrite(damaged));
    absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::OpenOrCreate(
        {.name = name_, .bytes = 4 << 20, .lock = PoolLockMode::kOff});
    ASSERT_OK(pool);
    absl::StatusOr<std::unique_ptr<Journal>> journal = Journal::OpenOrCreate(name_, 1 << 20);
    ASSERT_OK(journal);
    const absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(
        pool->get(), journal->get(), {backend_.get(), nullptr}, {.chunk_bytes = 64 * 1024},
        CommitMode::kLocal);
    EXPECT_STATUS(store, absl::StatusCode::kDataLoss) << damage.what;
    EXPECT_TRUE(absl::StrContains(store.status().message(), "region 'region0' of rank 0") &&
                absl::StrContains(store.status().message(), damage.what))
        << store.status();
  }
  // The entry as written is used again, and restores what was committed.
  ASSERT_NO_FATAL_FAILURE(rewrite(written));
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal));
  ASSERT_NO_FATAL_FAILURE(Connect(0, 1));
  std::memset(trainers_.at(0).data, 0, trainers_.at(0).bytes);
  ASSERT_OK(store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(std::vector<uint8_t>(trainers_.at(0).data, trainers_.at(0).data + trainers_.at(0).bytes),
            committed);
}

TEST_F(StoreTest, CommitsLaggingBehindTrainingSkipStepsInsteadOfFillingThePool) {
  CaptureOptions options;
  options.max_in_flight_steps = 2;
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 4 << 20, options));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  EXPECT_TRUE(Take(0, 1).skipped().empty());
  ASSERT_OK(WaitCaptured(0, 1));
  EXPECT_TRUE(Take(0, 2).skipped().empty());
  ASSERT_OK(WaitCaptured(0, 2));
  // Steps 1 and 2 wait for the cluster: step 3 is skipped, and it is not an error.
  const v1::SnapshotResponse third = Take(0, 3);
  EXPECT_TRUE(absl::StrContains(third.skipped(), "steps 1, 2 still wait for their commit"))
      << third.skipped();
  EXPECT_EQ(third.bytes(), 0u);
  absl::StatusOr<v1::StepState> state = WaitCaptured(0, 3);
  ASSERT_OK(state);  // the trainer goes on
  EXPECT_EQ(*state, v1::STEP_STATE_ABORTED);
  const uint64_t in_flight = store_->Status().pool_in_flight_bytes();
  EXPECT_EQ(in_flight, 2 * 2 * kRegionBytes);  // two steps of two regions, no more

  // The cluster commits step 2 (step 1 is superseded): room for the next snapshot.
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(2));
  EXPECT_TRUE(Take(0, 4).skipped().empty());
  const v1::StatusResponse status = store_->Status();
  EXPECT_EQ(status.steps_superseded(), 1u);
  EXPECT_EQ(status.snapshots_skipped(), 1u);
  EXPECT_TRUE(absl::StrContains(status.last_skip(), "rank 0, step 3")) << status.last_skip();
  EXPECT_EQ(store_->LatestCommitted(0), 2);
}

TEST_F(StoreTest, RegionsLargerThanThePoolAreSkippedNamingThePool) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal, 4 << 20));
  ASSERT_NO_FATAL_FAILURE(ConnectSized(0, {3 << 20, 3 << 20}));
  // One of the regions fits.
  absl::StatusOr<v1::SnapshotResponse> one = store_->Snapshot(0, 1, {"region0"});
  ASSERT_OK(one);
  EXPECT_TRUE(one->skipped().empty()) << one->skipped();
  ASSERT_OK(WaitCaptured(0, 1));
  // Both never fit, whatever is committed.
  const v1::SnapshotResponse whole = Take(0, 2);
  EXPECT_TRUE(absl::StrContains(whole.skipped(), "it needs 6291456 bytes (6.0 MiB) for 2 regions"))
      << whole.skipped();
  EXPECT_TRUE(absl::StrContains(whole.skipped(), "more than the whole pool")) << whole.skipped();
  absl::StatusOr<v1::StepState> state = WaitCaptured(0, 2);
  ASSERT_OK(state);  // the trainer goes on
  EXPECT_EQ(*state, v1::STEP_STATE_ABORTED);
  EXPECT_EQ(*store_->LatestCommitted(0), 1);
}

TEST_F(StoreTest, ARankHoldsAtMostTheBoundOfRegionsAcrossRegistrations) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal));
  ASSERT_NO_FATAL_FAILURE(ConnectSized(0, std::vector<uint64_t>(kMaxRegionsPerRank, 1)));
  v1::RegionSpec spec;
  spec.set_device(v1::DEVICE_HOST);
  spec.set_bytes(1);
  spec.mutable_handle()->set_memory(trainers_.at(0).memory);
  spec.set_name("region0");  // registered again: the rank holds no more regions than before
  EXPECT_OK(store_->RegisterRegions(0, {spec}));
  spec.set_name("one-more");
  const absl::Status refused = store_->RegisterRegions(0, {spec});
  EXPECT_STATUS(refused, absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(refused.message(), "rank 0 would hold 262145 regions")) << refused;
}

TEST_F(StoreTest, AFullPoolSkipsTheStepAndKeepsWhatIsCommitted) {
  CaptureOptions options;  // no bound on the steps in flight: the pool is the limit
  // Room for the committed step and one more of 2 regions, not two more.
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 5 * 2 * kRegionBytes / 2, options));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  Take(0, 1);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  EXPECT_TRUE(Take(0, 2).skipped().empty());
  ASSERT_OK(WaitCaptured(0, 2));
  const v1::SnapshotResponse third = Take(0, 3);
  EXPECT_TRUE(absl::StrContains(third.skipped(), "the pool has")) << third.skipped();
  ASSERT_OK(WaitCaptured(0, 3));
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(2));
  std::memset(trainers_[0].data, 0, trainers_[0].bytes);
  absl::StatusOr<v1::RestoreResponse> restored =
      store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30));
  ASSERT_OK(restored);
  EXPECT_EQ(restored->step(), 2);
  EXPECT_EQ(trainers_[0].data[trainers_[0].bytes - 1], 2);
}

// In a cluster, steps captured faster than they commit must not take the pool space the parity of
// the step being encoded needs: once they did, every step aborted for want of parity space and
// nothing committed again. Captures leave 2 x parity_share x the largest image free.
TEST_F(StoreTest, CapturesLeaveRoomForTheParityOfStepsBeingEncoded) {
  CaptureOptions options;
  options.parity_share = 0.5;  // k = 4, m = 2: the parity of a step is kept at one step's bytes
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 16 * kRegionBytes, options));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  const uint64_t step_bytes = 2 * kRegionBytes;
  int64_t step = 1;
  std::string skipped;
  for (; skipped.empty() && step < 100; ++step) {
    skipped = Take(0, step).skipped();
    ASSERT_OK(WaitCaptured(0, step));
  }
  EXPECT_TRUE(absl::StrContains(skipped, "for the parity of steps being encoded")) << skipped;
  // Steps 1-7 fit in the 16 regions' space beside the two kept for parity; step 8 is skipped.
  EXPECT_EQ(step - 1, 8);
  EXPECT_GE(pool_->free_bytes(), step_bytes);
  ASSERT_OK(pool_->Allocate(step_bytes));  // the parity's units find their room
  // The steps captured commit; the next capture finds room again.
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(step - 2));
  EXPECT_TRUE(Take(0, step).skipped().empty());
}

TEST_F(StoreTest, FragmentedFreeSpaceStillTakesASnapshotThatFitsAndRestoresItExactly) {
  // Six ranks fill the pool; dropping ranks 1 and 3 leaves two holes, apart, of one region each.
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal, 6 * kRegionBytes));
  for (uint32_t rank = 0; rank < 6; ++rank) {
    ASSERT_NO_FATAL_FAILURE(Connect(rank, 1));
    Take(rank, 1);
    ASSERT_OK(store_->WaitCommitted(rank, 1, absl::Now() + absl::Seconds(30), [] { return false; }));
  }
  ASSERT_OK(store_->DropStep(1, 1));
  ASSERT_OK(store_->DropStep(1, 3));
  ASSERT_EQ(pool_->free_bytes(), 2 * kRegionBytes);
  EXPECT_STATUS(pool_->Allocate(2 * kRegionBytes), absl::StatusCode::kResourceExhausted);

  // A region as large as both holes together is stored across them, and comes back exactly.
  ASSERT_NO_FATAL_FAILURE(Connect(6, 1, 2 * kRegionBytes));
  Trainer& trainer = trainers_[6];
  for (uint64_t i = 0; i < trainer.bytes; ++i) trainer.data[i] = static_cast<uint8_t>(i * 13 + 5);
  absl::StatusOr<v1::SnapshotResponse> taken = store_->Snapshot(6, 1, {});
  ASSERT_OK(taken);
  EXPECT_TRUE(taken->skipped().empty()) << taken->skipped();
  ASSERT_OK(store_->WaitCommitted(6, 1, absl::Now() + absl::Seconds(30), [] { return false; }));
  std::vector<uint8_t> expected(trainer.data, trainer.data + trainer.bytes);
  std::memset(trainer.data, 0, trainer.bytes);
  ASSERT_OK(store_->Restore(6, std::nullopt, {}, absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(std::memcmp(trainer.data, expected.data(), expected.size()), 0);
  EXPECT_EQ(store_->Verify(std::nullopt).corruptions_size(), 0);
}

TEST_F(StoreTest, ThousandsOfSmallRegionsAreCapturedAndRestoredExactlyInOneReservation) {
  // Sizes that are not multiples of the pool's alignment, and one region larger than a chunk.
  constexpr int kRegions = 3000;
  constexpr uint64_t kSmall = 1000;
  Open(CommitMode::kLocal, 16 << 20);
  const uint64_t empty = pool_->free_bytes();
  Connect(0, kRegions, kSmall);
  Trainer& trainer = trainers_.at(0);
  auto fill = [&](int64_t step) {
    for (uint64_t i = 0; i < trainer.bytes; ++i) {
      trainer.data[i] = static_cast<uint8_t>(i * 7 + step * 131 + i / kSmall);
    }
  };
  for (int64_t step = 1; step <= 3; ++step) {
    fill(step);
    absl::StatusOr<v1::SnapshotResponse> taken = store_->Snapshot(0, step, {});
    ASSERT_OK(taken);
    EXPECT_EQ(taken->bytes(), kRegions * kSmall);
    ASSERT_OK(WaitCaptured(0, step));
  }
  // One version per region of the last step is all the pool holds, each in its aligned space.
  EXPECT_EQ(pool_->free_bytes(), empty - kRegions * PoolReservation::SpaceFor(kSmall));

  std::vector<uint8_t> expected(trainer.data, trainer.data + trainer.bytes);
  std::memset(trainer.data, 0, trainer.bytes);
  absl::StatusOr<v1::RestoreResponse> restored =
      store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30));
  ASSERT_OK(restored);
  EXPECT_EQ(restored->step(), 3);
  EXPECT_EQ(restored->restored().steps_size(), kRegions);
  EXPECT_EQ(std::vector<uint8_t>(trainer.data, trainer.data + trainer.bytes), expected);

  // A step naming a few regions plans its own copy and restores them alone.
  fill(4);
  ASSERT_OK(store_->Snapshot(0, 4, {"region7", "region2999"}));
  ASSERT_OK(WaitCaptured(0, 4));
  std::vector<uint8_t> step4(trainer.data, trainer.data + trainer.bytes);
  std::memset(trainer.data, 0, trainer.bytes);
  ASSERT_OK(store_->Restore(0, std::nullopt, {"region7", "region2999"},
                            absl::Now() + absl::Seconds(30)));
  for (uint64_t region : {7u, 2999u}) {
    EXPECT_EQ(std::memcmp(trainer.data + region * kSmall, step4.data() + region * kSmall, kSmall), 0)
        << "region " << region;
  }
}

TEST_F(StoreTest, ANewProcessDeclaringAnotherDtypeOrShapeIsToldWhichRegionAndBothTypes) {
  // Eight regions of 4 KiB declared as two layers' weights and biases: a table keeps each distinct
  // type once, so a region of a type its neighbours share must still be checked as its own.
  Open(CommitMode::kLocal, 16 << 20);
  const std::vector<uint64_t> sizes(8, 4096);
  std::vector<DeclaredType> stored;
  for (int i = 0; i < 8; ++i) {
    stored.push_back(i % 2 == 0 ? DeclaredType{"float32", {32, 32}}
                                : DeclaredType{"bfloat16", {2048}});
  }
  ConnectSized(0, sizes, {}, stored);
  const std::vector<uint8_t> committed = CommitRandomBytes(0, 17);

  auto restore_declaring = [&](std::vector<DeclaredType> types) {
    ConnectSized(0, sizes, {}, types);  // a new process of the rank
    return store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30)).status();
  };
  std::vector<DeclaredType> types = stored;
  types[5] = stored[4];  // region5 declared as its neighbour region4, of the same bytes
  absl::Status refused = restore_declaring(types);
  EXPECT_STATUS(refused, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.message(),
                                "region 'region5' is float32 in this trainer, but step 1 stored "
                                "bfloat16"))
      << refused;

  types = stored;
  types[6].shape = {1024, 1};  // the same bytes, another shape
  refused = restore_declaring(types);
  EXPECT_STATUS(refused, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.message(),
                                "region 'region6' has shape [1024, 1] in this trainer, but step 1 "
                                "stored [32, 32]"))
      << refused;

  // Undeclared types restore into whatever was stored; the declared ones as stored, exactly.
  for (std::vector<DeclaredType> accepted : {std::vector<DeclaredType>{}, stored}) {
    ConnectSized(0, sizes, {}, accepted);
    std::memset(trainers_.at(0).data, 0, trainers_.at(0).bytes);
    ASSERT_OK(store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30)));
    EXPECT_EQ(std::vector<uint8_t>(trainers_.at(0).data,
                                   trainers_.at(0).data + trainers_.at(0).bytes),
              committed);
  }
}

TEST_F(StoreTest, ARunOfSmallRegionsIsOneBatchAndAFailedBatchNamesItsRegions) {
  auto recording = std::make_unique<BatchRecordingBackend>(std::move(backend_));
  BatchRecordingBackend* batches = recording.get();
  backend_ = std::move(recording);
  Open(CommitMode::kLocal, 16 << 20);
  Connect(0, 100, 1000);  // 100 KB of small regions: two tasks of up to a 64 KiB chunk each
  Take(0, 1);
  ASSERT_OK(WaitCaptured(0, 1));
  std::vector<size_t> out = batches->out_batches();
  std::sort(out.begin(), out.end());
  EXPECT_THAT(out, ::testing::ElementsAre(35, 65));  // a transfer per region, a batch per task
  Trainer& trainer = trainers_.at(0);
  std::memset(trainer.data, 0, trainer.bytes);
  ASSERT_OK(store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(std::vector<uint8_t>(trainer.data, trainer.data + trainer.bytes),
            std::vector<uint8_t>(trainer.bytes, 1));
  std::vector<size_t> in = batches->in_batches();
  std::sort(in.begin(), in.end());
  EXPECT_THAT(in, ::testing::ElementsAre(35, 65));

  batches->FailCopiesOut();
  Take(0, 2);
  absl::StatusOr<v1::StepState> failed = WaitCaptured(0, 2);
  ASSERT_FALSE(failed.ok());
  // Either task may fail first; its message names the first and last region of its batch, in the
  // order regions are copied in: that of the trainer's memory (region0, region1, region2, ...),
  // not of their names (region0, region1, region10, ...).
  EXPECT_THAT(std::string(failed.status().message()),
              ::testing::AnyOf(::testing::HasSubstr("copy of the 65 regions from 'region0' to "
                                                    "'region64' failed: injected copy failure"),
                               ::testing::HasSubstr("copy of the 35 regions from 'region65' to "
                                                    "'region99' failed: injected copy failure")));
  // A failed restore batch names its regions alike.
  batches->FailCopiesIn();
  const absl::Status restored =
      store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30)).status();
  ASSERT_FALSE(restored.ok());
  EXPECT_THAT(std::string(restored.message()),
              ::testing::AnyOf(::testing::HasSubstr("restore of the 65 regions from 'region0' to "
                                                    "'region64' failed: injected copy failure"),
                               ::testing::HasSubstr("restore of the 35 regions from 'region65' "
                                                    "to 'region99' failed: injected copy failure")));
}

TEST_F(StoreTest, ADamagedRegionInARunOfSmallOnesIsNamedAndTheRestAreRestoredExactly) {
  // Twelve regions of 4 KiB lie one after another in the trainer's memory (region0, region1, ...,
  // region11, not the order of their names) and, laid out in that order, in the pool: a restore
  // copies them as one run checked against their CRCs joined. One byte of region10 is then damaged
  // in the pool: the run's check fails, and each region is checked alone, so that the error names
  // region10.
  constexpr int kRegions = 12;
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal, 16 << 20));
  ASSERT_NO_FATAL_FAILURE(ConnectSized(0, std::vector<uint64_t>(kRegions, 4096)));
  Trainer& trainer = trainers_.at(0);
  const std::vector<uint8_t> expected = CommitRandomBytes(0, 19);
  uint8_t* const pool_end = pool_->base() + pool_->capacity();
  uint8_t* const stored = std::search(pool_->base(), pool_end, expected.begin(), expected.end());
  ASSERT_NE(stored, pool_end) << "the regions are not laid out in the pool as in the trainer";

  std::memset(trainer.data, 0, trainer.bytes);
  ASSERT_OK(store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30)));
  ASSERT_EQ(std::vector<uint8_t>(trainer.data, trainer.data + trainer.bytes), expected);

  stored[10 * 4096 + 100] ^= 0x01;
  ExpectRestoreFindsDamage(0, "region 'region10' of rank 0, step 1, chunk 0");
  for (int region = 0; region < kRegions; ++region) {
    if (region == 10) continue;
    EXPECT_EQ(std::memcmp(trainer.data + region * 4096, expected.data() + region * 4096, 4096), 0)
        << "region" << region;
  }
}

// Steps of every region and of some alternate, each capture reusing the per-region table of the
// step committed before it (larger or smaller than it needs): every restore gives back each
// region's bytes of the latest step that took it.
TEST_F(StoreTest, StepsOfAllAndOfSomeRegionsRestoreEachRegionsLatestBytes) {
  constexpr int kRegions = 3;
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal, 16 << 20));
  ASSERT_NO_FATAL_FAILURE(Connect(0, kRegions));
  Trainer& trainer = trainers_.at(0);
  struct Step {
    int64_t step;
    std::vector<std::string> regions;  // empty: all
  };
  std::vector<int> latest(kRegions, 0);  // the step whose bytes each region holds
  for (const Step& taken : {Step{1, {}}, Step{2, {"region1"}}, Step{3, {}},
                            Step{4, {"region0", "region2"}}, Step{5, {"region2"}}}) {
    std::memset(trainer.data, static_cast<int>(taken.step), trainer.bytes);
    ASSERT_OK(store_->Snapshot(0, taken.step, taken.regions));
    ASSERT_OK(store_->WaitCommitted(0, taken.step, absl::Now() + absl::Seconds(30),
                                    [] { return false; }));
    for (int region = 0; region < kRegions; ++region) {
      if (taken.regions.empty() ||
          std::find(taken.regions.begin(), taken.regions.end(),
                    absl::StrCat("region", region)) != taken.regions.end()) {
        latest[region] = static_cast<int>(taken.step);
      }
    }
    std::memset(trainer.data, 0, trainer.bytes);
    ASSERT_OK(store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30)));
    for (int region = 0; region < kRegions; ++region) {
      const std::vector<uint8_t> expected(kRegionBytes, static_cast<uint8_t>(latest[region]));
      EXPECT_EQ(std::vector<uint8_t>(trainer.data + region * kRegionBytes,
                                     trainer.data + (region + 1) * kRegionBytes),
                expected)
          << "region" << region << " after step " << taken.step;
    }
  }
}

TEST_F(StoreTest, ARegionLargerThanAChunkAmongSmallOnesIsCopiedChunkByChunk) {
  Open(CommitMode::kLocal, 16 << 20);
  Connect(0, 3, 5 * 64 * 1024 + 17);  // five chunks and a bit, three times
  Take(0, 1);
  ASSERT_OK(WaitCaptured(0, 1));
  Trainer& trainer = trainers_.at(0);
  std::memset(trainer.data, 0xee, trainer.bytes);
  absl::StatusOr<v1::RestoreResponse> restored =
      store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30));
  ASSERT_OK(restored);
  EXPECT_EQ(std::vector<uint8_t>(trainer.data, trainer.data + trainer.bytes),
            std::vector<uint8_t>(trainer.bytes, 1));
}

TEST_F(StoreTest, ARestoreChecksEveryChunkAndFailsOnOneCorruptByteInThePool) {
  // Region1 spans five chunks and a bit at misaligned sizes; one byte of its third chunk is damaged
  // in the pool after the commit: the restore of the rank fails with DATA_LOSS naming the chunk,
  // and a restore of region0 alone still succeeds.
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal, 16 << 20));
  ASSERT_NO_FATAL_FAILURE(ConnectSized(0, {3 * 64 * 1024 + 5, 5 * 64 * 1024 + 17}));
  Trainer& trainer = trainers_.at(0);
  const std::vector<uint8_t> expected = CommitRandomBytes(0, 18);

  // Where region1's chunk 2 landed in the pool: found by 64 of its (random) bytes.
  const uint64_t region1 = 3 * 64 * 1024 + 5;
  const uint8_t* needle = expected.data() + region1 + 2 * 64 * 1024 + 1000;
  uint8_t* const pool_end = pool_->base() + pool_->capacity();
  uint8_t* const found = std::search(pool_->base(), pool_end, needle, needle + 64);
  ASSERT_NE(found, pool_end);
  *found ^= 0x10;

  ExpectRestoreFindsDamage(0, "region 'region1' of rank 0, step 1, chunk 2");
  const v1::VerifyResponse verify = store_->Verify(std::nullopt);
  ASSERT_EQ(verify.corruptions_size(), 1);
  EXPECT_EQ(verify.corruptions(0).region(), "region1");
  EXPECT_EQ(verify.corruptions(0).chunk(), 2u);

  std::memset(trainer.data, 0, trainer.bytes);
  ASSERT_OK(store_->Restore(0, std::nullopt, {"region0"}, absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(std::memcmp(trainer.data, expected.data(), region1), 0);
}

TEST_F(StoreTest, ARestoreOfTheWholeRankStartsANewTimeline) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  Take(0, 1);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  Take(0, 2);
  ASSERT_OK(WaitCaptured(0, 2));
  Take(0, 3);  // captured later, never committed (the job died)
  ASSERT_OK(WaitCaptured(0, 3));
  EXPECT_EQ(store_->CaptureOf(3), NodeCapture::kCaptured);
  EXPECT_EQ(store_->CaptureOf(4), NodeCapture::kNotYet);
  EXPECT_EQ(store_->WaitNewNodeCapture(absl::Now() + absl::Seconds(30)).value_or(-1), 2);
  EXPECT_EQ(store_->WaitNewNodeCapture(absl::Now() + absl::Seconds(30)).value_or(-1), 3);
  ASSERT_NO_FATAL_FAILURE(Connect(0));  // the job restarts
  // A restore of some regions only (a sparse replay) keeps the timeline: step 2 stands as captured
  // by the process before, and snapshotting it again copies nothing ...
  ASSERT_OK(store_->Restore(0, std::nullopt, {"region0"}, absl::Now() + absl::Seconds(30)));
  absl::StatusOr<v1::SnapshotResponse> replayed = store_->Snapshot(0, 2, {});
  ASSERT_OK(replayed);
  EXPECT_EQ(replayed->bytes(), 0u);
  // ... a restore of the whole rank starts a new one from step 1.
  absl::StatusOr<v1::RestoreResponse> restored =
      store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30));
  ASSERT_OK(restored);
  EXPECT_EQ(restored->step(), 1);
  // Steps 2 and 3 are still to come, not passed, and the cluster is offered them again.
  EXPECT_EQ(store_->CaptureOf(2), NodeCapture::kNotYet);
  EXPECT_EQ(store_->CaptureOf(3), NodeCapture::kNotYet);
  const v1::SnapshotResponse again = Take(0, 2);
  EXPECT_TRUE(again.skipped().empty());
  EXPECT_EQ(again.bytes(), 2 * kRegionBytes);
  ASSERT_OK(WaitCaptured(0, 2));
  EXPECT_EQ(store_->CaptureOf(2), NodeCapture::kCaptured);
  EXPECT_EQ(store_->WaitNewNodeCapture(absl::Now() + absl::Seconds(30)).value_or(-1), 2);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(2));
  EXPECT_EQ(store_->LatestCommitted(0), 2);
  Take(0, 4);  // the trainer did not snapshot step 3: it will never be captured
  EXPECT_EQ(store_->CaptureOf(3), NodeCapture::kPassed);
  // A Prepare of it says so at once instead of waiting out its deadline.
  const absl::Time asked = absl::Now();
  EXPECT_STATUS(store_->WaitNodeCaptured(3, asked + absl::Seconds(30)),
                absl::StatusCode::kFailedPrecondition);
  EXPECT_LT(absl::Now() - asked, absl::Seconds(30));
}

// A step that names some regions takes along those an earlier uncommitted step changed, but not
// those of a step the whole restore ended: the restore put them back to the committed step.
TEST_F(StoreTest, ANamedStepAfterAWholeRestoreTakesNothingOfTheEndedTimeline) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  Take(0, 1);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  Take(0, 2);  // captured, never committed (the job died)
  ASSERT_OK(WaitCaptured(0, 2));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  ASSERT_OK(store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30)));
  absl::StatusOr<v1::SnapshotResponse> named = store_->Snapshot(0, 3, {"region0"});
  ASSERT_OK(named);
  EXPECT_EQ(named->bytes(), kRegionBytes);
  ASSERT_OK(WaitCaptured(0, 3));
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(3));
  EXPECT_EQ(store_->LatestCommitted(0), 3);
}

// The cluster aborted a step this node offered; its rank then takes the step number again (a
// replacement trainer replaying it). The new capture is offered too: the cluster must decide it,
// or a sparse window holding it would wait for a decision forever.
TEST_F(StoreTest, AStepTakenAgainAfterTheClusterAbortedItIsOfferedAgain) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  Take(0, 1);
  ASSERT_OK(WaitCaptured(0, 1));
  EXPECT_EQ(store_->WaitNewNodeCapture(absl::Now() + absl::Seconds(30)).value_or(-1), 1);
  EXPECT_STATUS(store_->WaitNewNodeCapture(absl::Now()), absl::StatusCode::kDeadlineExceeded);
  store_->AbortNodeStep(1, absl::AbortedError("a node did not prepare"));
  const v1::SnapshotResponse again = Take(0, 1);
  EXPECT_EQ(again.bytes(), 2 * kRegionBytes);
  ASSERT_OK(WaitCaptured(0, 1));
  EXPECT_EQ(store_->WaitNewNodeCapture(absl::Now() + absl::Seconds(30)).value_or(-1), 1);
  EXPECT_STATUS(store_->WaitNewNodeCapture(absl::Now()), absl::StatusCode::kDeadlineExceeded);
}

// A trainer killed after its step was captured and before the cluster asked for it (commits lag
// behind training): the bytes are in the pool, and the step commits without the trainer.
TEST_F(StoreTest, AStepCapturedBeforeItsTrainerWasKilledStillCommits) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  Take(0, 1);
  ASSERT_OK(WaitCaptured(0, 1));
  store_->EndSession(0, trainers_.at(0).session);
  ASSERT_EQ(store_->CaptureOf(1), NodeCapture::kCaptured);
  EXPECT_EQ(store_->CaptureOf(2), NodeCapture::kNotYet);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  EXPECT_EQ(store_->LatestCommitted(0), 1);
  // Its replacement restores the step.
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  std::memset(trainers_.at(0).data, 0, trainers_.at(0).bytes);
  absl::StatusOr<v1::RestoreResponse> restored =
      store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30));
  ASSERT_OK(restored);
  EXPECT_EQ(restored->step(), 1);
  EXPECT_EQ(std::vector<uint8_t>(trainers_.at(0).data, trainers_.at(0).data + trainers_.at(0).bytes),
            std::vector<uint8_t>(trainers_.at(0).bytes, 1));
}

// Two ranks killed, one before it took the step (a replica group's member, its shard missing): with
// no trainer left to say which ranks take it, the step is not captured, and does not commit.
TEST_F(StoreTest, AStepNotEveryRankTookBeforeAllWereKilledIsNotCaptured) {
  ASSERT_NO_FATAL_FAILURE(CommitTwoRanksInCluster());
  Take(0, 2);
  ASSERT_OK(WaitCaptured(0, 2));
  EXPECT_EQ(store_->CaptureOf(2), NodeCapture::kNotYet);  // rank 1's trainer takes it yet
  store_->EndSession(0, trainers_.at(0).session);
  store_->EndSession(1, trainers_.at(1).session);
  EXPECT_EQ(store_->CaptureOf(2), NodeCapture::kNotYet);
  const absl::StatusOr<NodeImage> timed_out = store_->WaitNodeCaptured(2, absl::Now() + absl::Milliseconds(50));
  EXPECT_STATUS(timed_out, absl::StatusCode::kDeadlineExceeded);
  // The operator reads which rank holds it back.
  EXPECT_TRUE(absl::StrContains(timed_out.status().message(), "ranks [1] known here did not capture it"))
      << timed_out.status();
}

// A replacement process replays steps its predecessor took; each stands as taken, with its
// outcome. One the cluster aborted after the predecessor had taken a later step is not taken again
// (a rank's steps are taken in order): nothing to copy, no error into the training loop, and its
// commit fails with the cluster's final decision. A step older than the steps the rank's record
// keeps is refused: no replay starts there.
TEST_F(StoreTest, AReplayedStepStandsAsTakenWithItsOutcomeEvenAborted) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  Take(0, 1);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  Take(0, 2);
  ASSERT_OK(WaitCaptured(0, 2));
  Take(0, 3);
  ASSERT_OK(WaitCaptured(0, 3));
  store_->AbortNodeStep(2, absl::AbortedError("node 1 did not prepare"));
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(3));
  ASSERT_NO_FATAL_FAILURE(Connect(0));  // the replacement, replaying from step 1
  for (int64_t step = 1; step <= 3; ++step) {
    absl::StatusOr<v1::SnapshotResponse> replayed = store_->Snapshot(0, step, {});
    ASSERT_OK(replayed) << "step " << step;
    EXPECT_EQ(replayed->bytes(), 0u) << "step " << step;
    EXPECT_TRUE(replayed->skipped().empty()) << "step " << step;
    EXPECT_OK(WaitCaptured(0, step)) << "step " << step;
  }
  const absl::StatusOr<v1::StepState> aborted =
      store_->WaitCommitted(0, 2, absl::Now() + absl::Seconds(30), [] { return false; });
  EXPECT_STATUS(aborted, absl::StatusCode::kAborted);
  EXPECT_TRUE(absl::StrContains(aborted.status().message(), "node 1 did not prepare")) << aborted.status();
  EXPECT_EQ(Take(0, 4).bytes(), 2 * kRegionBytes);
  ASSERT_OK(WaitCaptured(0, 4));
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(4));
  EXPECT_EQ(store_->LatestCommitted(0), 4);
}

// A replay goes forward as the predecessor's steps did (a step taken again, as a client retrying
// its call does, stands), and ends with the first step past them: a step taken again after that is
// refused, not skipped as replayed.
TEST_F(StoreTest, AReplayGoesForwardAndEndsWithTheFirstNewStep) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  for (int64_t step = 1; step <= 3; ++step) {
    Take(0, step);
    ASSERT_NO_FATAL_FAILURE(CommitInCluster(step));
  }
  ASSERT_NO_FATAL_FAILURE(Connect(0));  // the replacement, replaying from step 2
  absl::StatusOr<v1::SnapshotResponse> replayed = store_->Snapshot(0, 2, {});
  ASSERT_OK(replayed);
  EXPECT_EQ(replayed->bytes(), 0u);
  replayed = store_->Snapshot(0, 2, {});  // the call retried
  ASSERT_OK(replayed);
  EXPECT_EQ(replayed->bytes(), 0u);
  const absl::StatusOr<v1::SnapshotResponse> back = store_->Snapshot(0, 1, {});
  EXPECT_STATUS(back, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(back.status().message(), "before step 2, the step its process replayed last"))
      << back.status();
  replayed = store_->Snapshot(0, 3, {});
  ASSERT_OK(replayed);
  EXPECT_EQ(replayed->bytes(), 0u);
  EXPECT_EQ(Take(0, 4).bytes(), 2 * kRegionBytes);  // past the predecessor's steps
  ASSERT_OK(WaitCaptured(0, 4));
  const absl::StatusOr<v1::SnapshotResponse> again = store_->Snapshot(0, 3, {});
  EXPECT_STATUS(again, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(again.status().message(), "not after step 4, its latest snapshot"))
      << again.status();
}

// A step past the predecessor's that is skipped (its commits lag) ends the replay as well.
TEST_F(StoreTest, ASkippedStepPastTheReplayEndsIt) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 4 << 20, {.max_in_flight_steps = 1}));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  Take(0, 1);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  Take(0, 2);
  ASSERT_OK(WaitCaptured(0, 2));  // waits for its commit
  ASSERT_NO_FATAL_FAILURE(Connect(0));  // the replacement, replaying from step 1
  absl::StatusOr<v1::SnapshotResponse> taken = store_->Snapshot(0, 1, {});
  ASSERT_OK(taken);
  EXPECT_EQ(taken->bytes(), 0u);
  taken = store_->Snapshot(0, 3, {});
  ASSERT_OK(taken);
  EXPECT_FALSE(taken->skipped().empty()) << "step 2 still waits for its commit";
  EXPECT_STATUS(store_->Snapshot(0, 2, {}), absl::StatusCode::kInvalidArgument);
}

TEST_F(StoreTest, AReplayOfAStepOlderThanTheStepsKeptIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  constexpr int64_t kSteps = 100;  // more than a rank's record keeps
  for (int64_t step = 1; step <= kSteps; ++step) {
    Take(0, step);
    ASSERT_NO_FATAL_FAILURE(CommitInCluster(step));
  }
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  EXPECT_STATUS(store_->Snapshot(0, 1, {}), absl::StatusCode::kInvalidArgument);
  EXPECT_OK(store_->Snapshot(0, kSteps, {}));  // the latest, kept: it stands as taken
}

// A step this node already offered the cluster may still commit: a rank restarting meanwhile
// restores only once it is decided, so that it cannot restore the step before one that then commits
// (the other ranks of a restarting job would restore that one).
TEST_F(StoreTest, ARestoreWaitsForTheDecisionOfAStepTheNodePrepared) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  Take(0, 1);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  Take(0, 2);
  ASSERT_OK(WaitCaptured(0, 2));
  ASSERT_OK(store_->WaitNodeCaptured(2, absl::Now() + absl::Seconds(30)));  // voted for step 2
  ASSERT_NO_FATAL_FAILURE(Connect(0));  // the job restarts
  absl::StatusOr<v1::RestoreResponse> early =
      store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Milliseconds(50));
  EXPECT_STATUS(early, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(early.status().message(), "step 2")) << early.status();

  absl::StatusOr<v1::RestoreResponse> restored;
  std::thread restore([&] {
    restored = store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30));
  });
  v1::JournalCluster record;
  record.set_committed_step(2);
  ASSERT_OK(store_->CommitNodeStep(2, record, {}));
  restore.join();
  ASSERT_OK(restored);
  EXPECT_EQ(restored->step(), 2);

  // Decided the other way: the restore takes the step before it.
  Take(0, 3);
  ASSERT_OK(WaitCaptured(0, 3));
  ASSERT_OK(store_->WaitNodeCaptured(3, absl::Now() + absl::Seconds(30)));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  restore = std::thread([&] {
    restored = store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30));
  });
  store_->AbortNodeStep(3, absl::AbortedError("a node voted no"));
  restore.join();
  ASSERT_OK(restored);
  EXPECT_EQ(restored->step(), 2);
}

// A trainer registered on a node that then installs an image (its replacement's rebuild) stays
// the rank's process: its exit ends its session, its regions with it, and the node's steps no
// longer wait for it.
TEST_F(StoreTest, ATrainerRegisteredBeforeAnImageIsInstalledEndsItsSessionAfter) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  Take(0, 1);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  v1::JournalCluster record;
  record.set_committed_step(1);
  ASSERT_OK(store_->InstallImage(store_->CommittedImage(), record));
  EXPECT_EQ(Take(0, 2).bytes(), 2 * kRegionBytes);  // still registered
  ASSERT_OK(WaitCaptured(0, 2));
  store_->EndSession(0, trainers_.at(0).session);
  const absl::StatusOr<v1::SnapshotResponse> after = store_->Snapshot(0, 3, {});
  EXPECT_STATUS(after, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(after.status().message(), "no registered regions")) << after.status();
}

// Each step's image of the node, steps dense and sparse, committed and aborted, with images held
// across later steps and let go, and a rank joining between two others: every image lists, region
// by region in (rank, name) order, the step the region's bytes were last kept at (this step's
// capture, or the committed step), their size and CRC, and reads back those bytes; and the journal
// each commit writes lists the committed ones.
TEST_F(StoreTest, EveryStepsImageAndEveryCommitsJournalHoldWhatEachRegionLastKept) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 16 << 20));
  constexpr uint64_t kBytes = 3000;
  const std::map<uint32_t, int> regions_of = {{0, 24}, {1, 6}, {2, 13}};
  struct Kept {
    int64_t step = 0;
    std::vector<uint8_t> bytes;
  };
  std::map<uint32_t, std::map<std::string, Kept>> committed;  // rank -> region -> kept
  std::set<uint32_t> whole_next;  // ranks whose next step must capture every region
  std::mt19937 random(7);
  std::deque<NodeImage> held;
  auto connect = [&](uint32_t rank) {
    const int count = regions_of.at(rank);
    ConnectSized(rank, std::vector<uint64_t>(count, kBytes), {},
                 std::vector<DeclaredType>(count, {"float32", {kBytes / 4}}));
    whole_next.insert(rank);
  };
  for (uint32_t rank : {0u, 2u}) ASSERT_NO_FATAL_FAILURE(connect(rank));
  for (int64_t step = 1; step <= 40; ++step) {
    if (step == 12) {  // rank 1's entries come between ranks 0's and 2's
      ASSERT_NO_FATAL_FAILURE(connect(1));
    }
    std::map<uint32_t, std::map<std::string, Kept>> taken;
    for (const auto& [rank, trainer] : trainers_) {
      const int count = regions_of.at(rank);
      std::vector<int> chosen;
      if (whole_next.erase(rank) > 0 || random() % 4 == 0) {
        for (int i = 0; i < count; ++i) chosen.push_back(i);
      } else {
        for (int i = 0; i < 1 + static_cast<int>(random() % 3); ++i) {
          chosen.push_back(static_cast<int>(random() % count));
        }
      }
      std::vector<std::string> names;
      for (int i : chosen) {
        const std::string name = absl::StrCat("region", i);
        Kept& kept = taken[rank][name];
        kept.step = step;
        kept.bytes =
            moesnap::testing::DeterministicBytes(step * 1000 + rank * 100 + i).Bytes(kBytes);
        std::memcpy(trainer.data + i * kBytes, kept.bytes.data(), kBytes);
        names.push_back(name);
      }
      if (static_cast<int>(chosen.size()) == count) names.clear();  // the whole rank
      ASSERT_OK(store_->Snapshot(rank, step, names)) << "rank " << rank << ", step " << step;
    }
    absl::StatusOr<NodeImage> image =
        store_->WaitNodeCaptured(step, absl::Now() + absl::Seconds(30));
    ASSERT_OK(image) << "step " << step;
    std::vector<uint8_t> expected_bytes;
    int position = 0;
    for (const auto& [rank, trainer] : trainers_) {
      std::map<std::string, Kept> kept = committed[rank];
      for (auto& [name, now] : taken[rank]) kept[name] = now;
      for (const auto& [name, region] : kept) {
        ASSERT_LT(position, image->manifest().regions_size()) << "step " << step;
        const v1::ImageRegion& entry = image->manifest().regions(position++);
        const std::string where = absl::StrCat("step ", step, ", rank ", rank, ", ", name);
        EXPECT_EQ(entry.rank(), rank) << where;
        EXPECT_EQ(entry.region(), name) << where;
        EXPECT_EQ(entry.step(), region.step) << where;
        EXPECT_EQ(entry.bytes(), kBytes) << where;
        EXPECT_EQ(entry.dtype(), "float32") << where;
        EXPECT_THAT(entry.shape(), ::testing::ElementsAre(kBytes / 4)) << where;
        EXPECT_THAT(entry.chunk_crcs(),
                    ::testing::ElementsAre(erasure::Crc32c(region.bytes.data(), kBytes)))
            << where;
        expected_bytes.insert(expected_bytes.end(), region.bytes.begin(), region.bytes.end());
      }
    }
    EXPECT_EQ(position, image->manifest().regions_size()) << "step " << step;
    std::vector<uint8_t> read(image->bytes());
    image->Read(0, read.size(), read.data());
    EXPECT_TRUE(read == expected_bytes) << "step " << step;
    EXPECT_EQ(image->manifest().step(), step);
    EXPECT_EQ(image->manifest().node_id(), 0u);
    std::string ranks;  // the ranks' records, which a commit makes the committed image's
    for (const v1::JournalRank& record : image->manifest().ranks()) {
      ranks += record.SerializeAsString();
    }
    image->set_node_id(7);  // as a participant names its node: the next image starts unnamed
    held.push_back(*std::move(image));
    while (held.size() > random() % 3) held.pop_front();
    if (random() % 4 == 0) {
      store_->AbortNodeStep(step, absl::AbortedError("the test aborts it"));
      for (const auto& [rank, kept] : taken) whole_next.insert(rank);
      continue;
    }
    v1::JournalCluster record;
    record.set_committed_step(step);
    ASSERT_OK(store_->CommitNodeStep(step, record, {}));
    for (auto& [rank, kept] : taken) {
      for (auto& [name, region] : kept) committed[rank][name] = std::move(region);
    }
    std::string committed_ranks;
    const NodeImage committed_image = store_->CommittedImage();
    for (const v1::JournalRank& rank : committed_image.manifest().ranks()) {
      committed_ranks += rank.SerializeAsString();
    }
    EXPECT_EQ(ranks, committed_ranks) << "step " << step;
    absl::StatusOr<std::unique_ptr<Journal>> written = Journal::OpenOrCreate(name_, 1 << 20);
    ASSERT_OK(written);
    const v1::JournalState& state = (*written)->recovered_state();
    int entry = 0;
    for (const auto& [rank, regions] : committed) {
      for (const auto& [name, region] : regions) {
        ASSERT_LT(entry, state.versions_size()) << "step " << step;
        const v1::JournalVersion& version = state.versions(entry++);
        const std::string where = absl::StrCat("journal of step ", step, ", rank ", rank, ", ", name);
        EXPECT_EQ(version.rank(), rank) << where;
        EXPECT_EQ(version.region(), name) << where;
        EXPECT_EQ(version.step(), region.step) << where;
        EXPECT_THAT(version.chunk_crcs(),
                    ::testing::ElementsAre(erasure::Crc32c(region.bytes.data(), kBytes)))
            << where;
      }
    }
    EXPECT_EQ(entry, state.versions_size()) << "step " << step;
  }
}

// A rank loaded from the durable tier whose record the journal cannot hold is not loaded: the rank
// stays as it was, its latest snapshot with it (a step captured since is not taken again).
TEST_F(StoreTest, ALoadedRankTheJournalCannotHoldLeavesTheRankAsItWas) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 4 << 20, {}, Journal::kMinimumBytes));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  Take(0, 1);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  Take(0, 2);
  ASSERT_OK(WaitCaptured(0, 2));
  // More regions' records than half the journal holds.
  std::vector<v1::ImageRegion> regions;
  for (int i = 0; i < 400; ++i) {
    v1::ImageRegion& region = regions.emplace_back();
    region.set_rank(0);
    region.set_region(absl::StrCat(std::string(100, 'r'), i));
    region.set_step(7);
    region.set_bytes(64);
    region.set_chunk_bytes(64);
    region.add_chunk_crcs(0);
  }
  v1::JournalRank record;
  record.set_rank(0);
  record.set_latest_committed_step(7);
  const absl::Status adopted = store_->AdoptCommitted(
      0, regions, record, [](int, uint32_t, uint8_t* out) {
        std::memset(out, 0, 64);
        return absl::OkStatus();
      });
  ASSERT_STATUS(adopted, absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->LatestCommitted(0), 1);
  const absl::StatusOr<v1::SnapshotResponse> again = store_->Snapshot(0, 2, {});
  EXPECT_STATUS(again, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(again.status().message(), "not after step 2")) << again.status();
}

// An elastic restore's holder finds one region of its committed image by name: the same record
// and bytes the whole image holds for it, only at the committed step.
TEST_F(StoreTest, ACommittedRegionIsFoundAsTheCommittedImageHoldsIt) {
  ASSERT_NO_FATAL_FAILURE(CommitTwoRanksInCluster());
  const NodeImage image = store_->CommittedImage();
  ASSERT_EQ(image.manifest().regions_size(), 4);
  for (int i = 0; i < image.manifest().regions_size(); ++i) {
    const v1::ImageRegion& expected = image.manifest().regions(i);
    absl::StatusOr<ClusterStore::HeldRegion> held =
        store_->CommittedRegion(1, expected.rank(), expected.region());
    ASSERT_OK(held);
    EXPECT_EQ(held->record.SerializeAsString(), expected.SerializeAsString())
        << expected.ShortDebugString();
    EXPECT_EQ(held->stored.get(), image.stored()[i].get()) << expected.ShortDebugString();
  }
  EXPECT_STATUS(store_->CommittedRegion(2, 0, "region0"), absl::StatusCode::kFailedPrecondition);
  EXPECT_STATUS(store_->CommittedRegion(1, 0, "region9"), absl::StatusCode::kNotFound);
  EXPECT_STATUS(store_->CommittedRegion(1, 7, "region0"), absl::StatusCode::kNotFound);
}

// A delta's committed side: the committed bytes of the regions a step's deltas read, found by name
// from the node's image of the committed step (as the cluster's record holds it), and only those;
// a region whose committed version is not the one the image names is refused, since XORing with
// it would send some other bytes' delta.
TEST_F(StoreTest, TheCommittedBytesOfTheRegionsADeltaReadsAreThoseTheCommittedImageNames) {
  ASSERT_NO_FATAL_FAILURE(CommitTwoRanksInCluster());
  Take(0, 2);
  Take(1, 2);
  absl::StatusOr<NodeImage> next = store_->WaitNodeCaptured(2, absl::Now() + absl::Seconds(30));
  ASSERT_OK(next);
  const NodeImage committed = store_->CommittedImage();
  const v1::NodeImage& named = committed.manifest();
  ASSERT_EQ(named.regions_size(), 4);
  for (const std::vector<int>& positions :
       {std::vector<int>{}, {0}, {3}, {1, 2}, {0, 1, 2, 3}}) {
    absl::StatusOr<std::vector<std::shared_ptr<PoolBytes>>> bytes =
        store_->CommittedBytesOf(named, positions);
    ASSERT_OK(bytes);
    ASSERT_EQ(bytes->size(), 4u);
    for (int i = 0; i < 4; ++i) {
      if (std::find(positions.begin(), positions.end(), i) == positions.end()) {
        EXPECT_EQ((*bytes)[i], nullptr) << i;
        continue;
      }
      EXPECT_EQ((*bytes)[i].get(), committed.stored()[i].get()) << i;
      EXPECT_NE((*bytes)[i].get(), next->stored()[i].get()) << i;  // step 2 captured it anew
    }
  }

  auto refused = [&](const std::function<void(v1::NodeImage&)>& change, int position) {
    v1::NodeImage other = named;
    change(other);
    return store_->CommittedBytesOf(other, {position}).status();
  };
  // Step 2's versions are captured, not committed.
  EXPECT_STATUS(refused([](v1::NodeImage& image) { image.mutable_regions(0)->set_step(2); }, 0),
                absl::StatusCode::kFailedPrecondition);
  EXPECT_STATUS(refused([](v1::NodeImage& image) {
                  image.mutable_regions(1)->set_bytes(image.regions(1).bytes() + 1);
                }, 1),
                absl::StatusCode::kFailedPrecondition);
  EXPECT_STATUS(refused([](v1::NodeImage& image) { image.mutable_regions(2)->set_region("x"); }, 2),
                absl::StatusCode::kFailedPrecondition);
  EXPECT_STATUS(refused([](v1::NodeImage& image) { image.mutable_regions(3)->set_rank(7); }, 3),
                absl::StatusCode::kFailedPrecondition);
  // Only the regions asked for are looked at.
  EXPECT_OK(refused([](v1::NodeImage& image) { image.mutable_regions(2)->set_region("x"); }, 1));
  EXPECT_STATUS(refused([](v1::NodeImage&) {}, 4), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(refused([](v1::NodeImage&) {}, -1), absl::StatusCode::kInvalidArgument);
  const absl::Status message =
      refused([](v1::NodeImage& image) { image.mutable_regions(2)->set_region("x"); }, 2);
  EXPECT_TRUE(absl::StrContains(message.message(), "'x'")) << message;
}

TEST_F(StoreTest, ATrainerThatGoesAwayNoLongerHoldsTheNodesStepsUnlessANewerOneStarted) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  ASSERT_NO_FATAL_FAILURE(Connect(1));
  Take(0, 1);
  // Rank 1 registered and never snapshots step 1: the node waits for it ...
  EXPECT_STATUS(store_->WaitNodeCaptured(1, absl::Now() + absl::Milliseconds(50)),
                absl::StatusCode::kDeadlineExceeded);
  const uint64_t first_session = trainers_[1].session;
  ASSERT_NO_FATAL_FAILURE(Connect(1));      // a newer process of rank 1
  store_->EndSession(1, first_session);     // the old one's late goodbye changes nothing
  EXPECT_STATUS(store_->WaitNodeCaptured(1, absl::Now() + absl::Milliseconds(50)),
                absl::StatusCode::kDeadlineExceeded);
  store_->EndSession(1, trainers_[1].session);  // ... until its process is gone
  EXPECT_OK(store_->WaitNodeCaptured(1, absl::Now() + absl::Seconds(30)));
}

TEST_F(StoreTest, AnIdleRankIsLeftOutOfTheNodesStepsUntilItSnapshotsAgain) {
  ASSERT_NO_FATAL_FAILURE(OpenTwoRanksInCluster(absl::Milliseconds(300)));
  Take(0, 1);
  // Rank 1 registered and never snapshots: once it is idle, step 1 is captured without it. Rank 0
  // took step 1, so it is waited for even if it turns idle while its copy runs (a loaded machine).
  ASSERT_OK(store_->WaitNodeCaptured(1, absl::Now() + absl::Seconds(30)));
  std::map<uint32_t, std::string> dropped = Dropped();
  ASSERT_TRUE(dropped.contains(1));
  EXPECT_TRUE(absl::StrContains(dropped[1], "capture.idle_rank_timeout_ms")) << dropped[1];
  v1::JournalCluster record;
  record.set_committed_step(1);
  ASSERT_OK(store_->CommitNodeStep(1, record, {}));
  // Its next snapshot brings it back: step 2 waits for it again.
  Take(1, 2);
  EXPECT_FALSE(Dropped().contains(1));
  Take(0, 2);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(2));
  EXPECT_EQ(*store_->LatestCommitted(1), 2);
}

// A rank left out of a step the node has offered to the cluster (idle when the step was prepared)
// and that snapshots the step late is skipped: the step commits the image the node offered, whose
// parity holds none of the late capture, so committing it too would leave the rank's committed
// bytes other than what the group's record and parity say. The rank stays at its committed step.
TEST_F(StoreTest, ARankLeftOutOfAStepTheNodeOfferedThatSnapshotsItLateIsSkipped) {
  NodeImage offered;
  ASSERT_NO_FATAL_FAILURE(OfferStepTwoWithoutRankOne(&offered));
  const v1::SnapshotResponse late = Take(1, 2);
  EXPECT_TRUE(absl::StrContains(late.skipped(), "offered")) << late.ShortDebugString();
  (void)WaitCaptured(1, 2);  // a capture, had it been taken, is complete before the commit
  v1::JournalCluster record;
  record.set_committed_step(2);
  ASSERT_OK(store_->CommitNodeStep(2, record, {}));
  EXPECT_EQ(*store_->LatestCommitted(0), 2);
  EXPECT_EQ(*store_->LatestCommitted(1), 1);
  const NodeImage committed = store_->CommittedImage();
  ASSERT_EQ(committed.manifest().regions_size(), offered.manifest().regions_size());
  for (int i = 0; i < committed.manifest().regions_size(); ++i) {
    EXPECT_EQ(committed.manifest().regions(i).SerializeAsString(),
              offered.manifest().regions(i).SerializeAsString())
        << committed.manifest().regions(i).ShortDebugString();
  }
  // Its next snapshot is the rank's next step, as after any skip.
  Take(1, 3);
  Take(0, 3);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(3));
  EXPECT_EQ(*store_->LatestCommitted(1), 3);
}

// The same late rank sending a slot of a window it never opened is refused, as any slot out of
// order is, before the step could be skipped as offered: nothing is recorded of the slot, and the
// step commits as offered.
TEST_F(StoreTest, ALateSparseSlotOfNoOpenWindowInAStepTheNodeOfferedIsRefused) {
  NodeImage offered;
  ASSERT_NO_FATAL_FAILURE(OfferStepTwoWithoutRankOne(&offered));
  v1::SparseSlot slot;
  slot.set_window_first_step(1);
  slot.set_window_size(2);
  slot.set_slot(1);
  const absl::StatusOr<v1::SnapshotResponse> late = store_->Snapshot(1, 2, {"region0"}, slot);
  EXPECT_STATUS(late, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(late.status().message(), "open window is none")) << late.status();
  EXPECT_FALSE(store_->Windows(1).has_open_window());
  EXPECT_FALSE(store_->Windows(1).has_committed_window());
  // A slot in order is skipped as offered, and its window, recorded, can no longer commit.
  slot.set_window_first_step(2);
  slot.set_slot(0);
  const absl::StatusOr<v1::SnapshotResponse> skipped = store_->Snapshot(1, 2, {"region0"}, slot);
  ASSERT_OK(skipped);
  EXPECT_TRUE(absl::StrContains(skipped->skipped(), "offered")) << skipped->ShortDebugString();
  EXPECT_TRUE(absl::StrContains(store_->Windows(1).open_window().failure(), "skipped"))
      << store_->Windows(1).ShortDebugString();
  v1::JournalCluster record;
  record.set_committed_step(2);
  ASSERT_OK(store_->CommitNodeStep(2, record, {}));
  EXPECT_EQ(*store_->LatestCommitted(0), 2);
  EXPECT_EQ(*store_->LatestCommitted(1), 1);
}

TEST_F(StoreTest, ARankThatTookAStepIsWaitedForHoweverLongItsCopyRuns) {
  HeldCopyBackend* copies = HoldCopies();
  ASSERT_NO_FATAL_FAILURE(OpenTwoRanksInCluster(absl::Milliseconds(1)));
  Take(0, 1);
  Take(1, 1);
  // Both ranks turn idle while their copies wait: they took the step, so the node waits for them.
  EXPECT_STATUS(store_->WaitNodeCaptured(1, absl::Now() + absl::Milliseconds(50)),
                absl::StatusCode::kDeadlineExceeded);
  copies->Release();
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  EXPECT_EQ(*store_->LatestCommitted(0), 1);
  EXPECT_EQ(*store_->LatestCommitted(1), 1);
}

// A trainer that gave up waiting for a capture (the daemon slow or paused) and went on to change its
// memory marks the snapshot's take: the capture, whose copy may hold bytes of the next step, ends
// aborted instead of committing. A take the trainer did not give up on commits.
TEST_F(StoreTest, ACaptureItsTrainerGaveUpOnIsAbortedAndOneItWaitedForCommits) {
  HeldCopyBackend* copies = HoldCopies();
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  const int fd = memfd_create("abandon-mark", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  absl::StatusOr<std::shared_ptr<TrainerMemory>> memory = TrainerMemory::Map(fd, geteuid(), {});
  close(fd);
  ASSERT_OK(memory);
  auto* count = reinterpret_cast<uint64_t*>((*memory)->data());
  auto mark = [&](uint64_t take) {
    v1::AbandonMark request;
    request.set_take(take);
    absl::StatusOr<AbandonMark> made = AbandonMark::In(*memory, request);
    EXPECT_OK(made);
    return *std::move(made);
  };

  Trainer& trainer = trainers_.at(0);
  std::memset(trainer.data, 1, trainer.bytes);
  ASSERT_OK(store_->Snapshot(0, 1, {}, std::nullopt, mark(1)));
  // The trainer's wait runs out while the copy waits: it marks the take and writes step 2.
  *count = 1;
  std::memset(trainer.data, 2, trainer.bytes);
  copies->Release();
  absl::StatusOr<v1::StepState> first = WaitCaptured(0, 1);
  EXPECT_STATUS(first, absl::StatusCode::kAborted);
  EXPECT_TRUE(absl::StrContains(first.status().message(), "gave up waiting")) << first.status();
  EXPECT_FALSE(store_->LatestCommitted(0).has_value());

  ASSERT_OK(store_->Snapshot(0, 2, {}, std::nullopt, mark(2)));
  ASSERT_OK(WaitCaptured(0, 2));
  EXPECT_EQ(store_->LatestCommitted(0), 2);
  std::memset(trainer.data, 0, trainer.bytes);
  copies->ReleaseCopiesIn();
  ASSERT_OK(store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30)));
  EXPECT_TRUE(std::all_of(trainer.data, trainer.data + trainer.bytes,
                          [](uint8_t byte) { return byte == 2; }));
}

// A trainer that snapshots its next step while the daemon still copies its last one went on
// without waiting for that capture (its wait ran out): the capture may hold bytes of the next
// step, so it ends aborted, and the next step is taken as any other.
TEST_F(StoreTest, ASnapshotWhileTheRanksLastStillCapturesAbortsThatCapture) {
  HeldCopyBackend* copies = HoldCopies();
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  Take(0, 1);
  EXPECT_TRUE(Take(0, 2).skipped().empty());
  copies->Release();
  absl::StatusOr<v1::StepState> first = WaitCaptured(0, 1);
  EXPECT_STATUS(first, absl::StatusCode::kAborted);
  EXPECT_TRUE(absl::StrContains(first.status().message(), "took step 2 before the capture ended"))
      << first.status();
  ASSERT_OK(WaitCaptured(0, 2));
  EXPECT_EQ(store_->LatestCommitted(0), 2);
}

TEST_F(StoreTest, ACopyOfATrainersMemoryCountsUntilItEndsEvenAfterTheTrainerIsGone) {
  HeldCopyBackend* copies = HoldCopies();
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  EXPECT_FALSE(store_->CopyingTrainerMemory(0));
  EXPECT_FALSE(store_->CopyingTrainerMemory(5));  // a rank the store never saw
  Take(0, 1);
  EXPECT_TRUE(store_->CopyingTrainerMemory(0));
  // The trainer dies with its capture queued: the capture still reads its memory.
  store_->EndSession(0, trainers_.at(0).session);
  EXPECT_TRUE(store_->CopyingTrainerMemory(0));
  copies->Release();
  ASSERT_OK(WaitCaptured(0, 1));
  EXPECT_FALSE(store_->CopyingTrainerMemory(0));  // counted off before the step is captured

  // A restore writes into the memory while it runs, and no longer once it returned.
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  std::thread restore([this] {
    EXPECT_OK(store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30)));
  });
  copies->AwaitCopyIn();
  EXPECT_TRUE(store_->CopyingTrainerMemory(0));
  copies->ReleaseCopiesIn();
  restore.join();
  EXPECT_FALSE(store_->CopyingTrainerMemory(0));
}

TEST_F(StoreTest, ARegistrationThatANewerProcessOvertookIsRefused) {
  HeldCopyBackend* copies = HoldCopies();
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  v1::RegionSpec late;
  late.set_name("late");
  late.set_device(v1::DEVICE_HOST);
  late.set_bytes(4096);
  late.mutable_handle()->set_memory(trainers_.at(0).memory);
  copies->HoldOpens();
  absl::Status registered;
  std::thread registration([&] { registered = store_->RegisterRegions(0, {late}); });
  copies->AwaitOpen();
  // A newer process of the rank starts (its Hello) while the first one's regions open: they are
  // not the newer process's, whose memory may be what the first one left.
  ASSERT_OK(store_->StartSession(0, trainers_.at(0).session + 1));
  copies->ReleaseOpens();
  registration.join();
  EXPECT_STATUS(registered, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(registered.message(), "newer process")) << registered;
}

// A trainer process that goes away holding nothing (no step taken, nothing committed) leaves
// nothing behind: a peer calling Hello for rank after rank cannot grow the daemon. A rank that
// committed a step, or took one, is kept for its next process.
TEST_F(StoreTest, ARankWhoseProcessLeavesHoldingNothingIsForgotten) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal));
  constexpr uint32_t kRanks = 10000;
  for (uint32_t rank = 100; rank < 100 + kRanks; ++rank) {
    ASSERT_OK(store_->StartSession(rank, rank));
    store_->EndSession(rank, rank);
  }
  EXPECT_EQ(store_->Status().ranks(), 0u);
  // A registration that comes after its process ended does not bring the rank back.
  v1::RegionSpec late;
  late.set_name("late");
  late.set_device(v1::DEVICE_HOST);
  late.set_bytes(4096);
  EXPECT_STATUS(store_->RegisterRegions(100, {late}), absl::StatusCode::kFailedPrecondition);
  EXPECT_STATUS(store_->Snapshot(100, 1, {}), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->Status().ranks(), 0u);
  // One that registered regions and took no step is forgotten as well.
  ASSERT_NO_FATAL_FAILURE(Connect(1));
  store_->EndSession(1, trainers_.at(1).session);
  EXPECT_EQ(store_->Status().ranks(), 0u);
  // One that committed a step stays, and its next process restores it.
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  const std::vector<uint8_t> committed = CommitRandomBytes(0, 7);
  store_->EndSession(0, trainers_.at(0).session);
  // One whose step was skipped stays too: the step stands as taken for its next process.
  ASSERT_NO_FATAL_FAILURE(Connect(2, 1, 8 << 20));
  EXPECT_FALSE(Take(2, 1).skipped().empty());
  store_->EndSession(2, trainers_.at(2).session);
  EXPECT_EQ(store_->Status().ranks(), 2u);
  EXPECT_EQ(store_->LatestCommitted(0), 1);
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  std::memset(trainers_.at(0).data, 0, trainers_.at(0).bytes);
  ASSERT_OK(store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(std::vector<uint8_t>(trainers_.at(0).data, trainers_.at(0).data + trainers_.at(0).bytes),
            committed);
  ASSERT_NO_FATAL_FAILURE(Connect(2, 1, 8 << 20));
  const absl::StatusOr<v1::StepState> skipped = WaitCaptured(2, 1);
  ASSERT_OK(skipped);
  EXPECT_EQ(*skipped, v1::STEP_STATE_ABORTED);
}

// Ranks with a trainer connected (or state held) count against a bound: a new rank past it is
// refused, naming the bound, while a rank already known still starts a new process, and a rank
// that leaves makes room.
TEST_F(StoreTest, ANewRankPastTheBoundOfRanksKnownIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal));
  for (uint32_t rank = 0; rank < kMaxRanksKnown; ++rank) {
    ASSERT_OK(store_->StartSession(rank, rank + 1));
  }
  const absl::Status refused = store_->StartSession(kMaxRanksKnown, kMaxRanksKnown + 1);
  EXPECT_STATUS(refused, absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(refused.message(), absl::StrCat("at most ", kMaxRanksKnown)))
      << refused;
  EXPECT_OK(store_->StartSession(7, kMaxRanksKnown + 2));
  store_->EndSession(7, kMaxRanksKnown + 2);
  EXPECT_OK(store_->StartSession(kMaxRanksKnown, kMaxRanksKnown + 3));
  EXPECT_EQ(store_->Status().ranks(), kMaxRanksKnown);
}

TEST_F(StoreTest, AnOperatorLeavesAStuckRankOut) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_NO_FATAL_FAILURE(Connect(0));
  ASSERT_NO_FATAL_FAILURE(Connect(1));
  Take(0, 1);
  EXPECT_STATUS(store_->WaitNodeCaptured(1, absl::Now() + absl::Milliseconds(50)),
                absl::StatusCode::kDeadlineExceeded);
  EXPECT_STATUS(store_->DropRank(7), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(store_->DropRank(1));
  ASSERT_OK(store_->WaitNodeCaptured(1, absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(Dropped(), (std::map<uint32_t, std::string>{{1, "dropped by an operator"}}));
}


// --- Replica groups: data-parallel ranks holding identical state, each capturing one shard ----

// Sizes not divisible by anything in particular: a region spans shards, small ones lie in one.
const std::vector<uint64_t> kReplicatedSizes{300001, 5000, 123457, 40960, 17};

v1::ReplicaGroup GroupOf(std::vector<uint32_t> ranks) {
  v1::ReplicaGroup group;
  group.set_name("data-parallel");
  for (uint32_t rank : ranks) group.add_ranks(rank);
  return group;
}

class ReplicaGroupStoreTest : public StoreTest {
 protected:
  // Every replica holds the same bytes for a step (as data-parallel ranks do), not its rank's.
  void FillReplicated(uint32_t rank, int64_t step) {
    Trainer& trainer = trainers_.at(rank);
    for (uint64_t i = 0; i < trainer.bytes; ++i) {
      trainer.data[i] = static_cast<uint8_t>((i * 2654435761u + static_cast<uint64_t>(step) * 97) >> 7);
    }
  }
  bool HoldsReplicated(uint32_t rank, int64_t step) const {
    const Trainer& trainer = trainers_.at(rank);
    for (uint64_t i = 0; i < trainer.bytes; ++i) {
      if (trainer.data[i] !=
          static_cast<uint8_t>((i * 2654435761u + static_cast<uint64_t>(step) * 97) >> 7)) {
        ADD_FAILURE() << "rank " << rank << " byte " << i << " differs from step " << step;
        return false;
      }
    }
    return true;
  }
  uint64_t TakeReplicated(uint32_t rank, int64_t step) {
    FillReplicated(rank, step);
    absl::StatusOr<v1::SnapshotResponse> taken = store_->Snapshot(rank, step, {});
    EXPECT_OK(taken);
    EXPECT_OK(WaitCaptured(rank, step));
    return taken.ok() ? taken->bytes() : 0;
  }
  // Zeroes the trainer's memory and restores the rank, which must give back `step` exactly.
  void ExpectRestores(uint32_t rank, int64_t step) {
    Trainer& trainer = trainers_.at(rank);
    std::memset(trainer.data, 0, trainer.bytes);
    absl::StatusOr<v1::RestoreResponse> restored =
        store_->Restore(rank, std::nullopt, {}, absl::Now() + absl::Seconds(30));
    ASSERT_OK(restored);
    EXPECT_EQ(restored->step(), step);
    ASSERT_EQ(restored->restored().steps_size(), static_cast<int>(kReplicatedSizes.size()));
    for (int64_t region_step : restored->restored().steps()) EXPECT_EQ(region_step, step);
    EXPECT_TRUE(HoldsReplicated(rank, step));
  }
  std::map<uint32_t, v1::RankCapture> Captures() const {
    std::map<uint32_t, v1::RankCapture> captures;
    const v1::StatusResponse status = store_->Status();
    for (const v1::RankCapture& capture : status.rank_captures()) {
      captures[capture.rank()] = capture;
    }
    return captures;
  }
};

uint64_t Total(const std::vector<uint64_t>& sizes) {
  uint64_t total = 0;
  for (uint64_t size : sizes) total += size;
  return total;
}

TEST_F(ReplicaGroupStoreTest, FourReplicasEachCopyAQuarterAndAnyOfThemRestoresEveryByte) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal, 8 << 20));
  const v1::ReplicaGroup group = GroupOf({0, 1, 2, 3});
  for (uint32_t rank = 0; rank < 4; ++rank) {
    ASSERT_NO_FATAL_FAILURE(ConnectSized(rank, kReplicatedSizes, group));
  }
  const uint64_t total = Total(kReplicatedSizes);
  uint64_t copied = 0;
  for (uint32_t rank = 0; rank < 4; ++rank) {
    const uint64_t bytes = TakeReplicated(rank, 1);
    EXPECT_NEAR(static_cast<double>(bytes), total / 4.0, 2 * kShardAlignment) << "rank " << rank;
    copied += bytes;
    // The step commits only with every shard: not before the last member captured it.
    EXPECT_EQ(store_->LatestCommitted(0), rank < 3 ? std::nullopt : std::optional<int64_t>(1));
  }
  EXPECT_EQ(copied, total);  // one copy of the state between the four of them
  const std::map<uint32_t, v1::RankCapture> captures = Captures();
  ASSERT_EQ(captures.size(), 4u);
  for (const auto& [rank, capture] : captures) {
    EXPECT_EQ(capture.step(), 1);
    EXPECT_EQ(capture.state_bytes(), total);
    EXPECT_LT(capture.bytes(), total / 4 + 2 * kShardAlignment);
  }
  for (uint32_t rank = 0; rank < 4; ++rank) ExpectRestores(rank, 1);

  // The step's layout is recorded with it: inspect shows each rank's group and piece.
  const v1::InspectStepResponse inspected = store_->InspectStep(1, 2);
  ASSERT_EQ(inspected.replica_groups_size(), 1);
  EXPECT_EQ(inspected.replica_groups(0).layout().group().ranks_size(), 4);
  ASSERT_GT(inspected.versions_size(), 0);
  EXPECT_TRUE(inspected.versions(0).has_piece());
}

TEST_F(ReplicaGroupStoreTest, AGroupOfThreeAfterARestartRestoresFromTheFourOldShards) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal, 8 << 20));
  for (uint32_t rank = 0; rank < 4; ++rank) {
    ASSERT_NO_FATAL_FAILURE(ConnectSized(rank, kReplicatedSizes, GroupOf({0, 1, 2, 3})));
  }
  for (uint32_t rank = 0; rank < 4; ++rank) TakeReplicated(rank, 1);
  ASSERT_EQ(store_->LatestCommitted(3), 1);
  // Rank 3 is gone; the job restarts with three replicas. Its state and the daemon's journal
  // (a restarted daemon too) hold the old layout.
  store_.reset();
  journal_.reset();
  pool_.reset();
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal, 8 << 20));
  const v1::ReplicaGroup three = GroupOf({0, 1, 2});
  for (uint32_t rank = 0; rank < 3; ++rank) {
    ASSERT_NO_FATAL_FAILURE(ConnectSized(rank, kReplicatedSizes, three));
    ExpectRestores(rank, 1);
  }
  // Training goes on with the new layout: thirds now, and restores still exact.
  uint64_t copied = 0;
  for (uint32_t rank = 0; rank < 3; ++rank) copied += TakeReplicated(rank, 2);
  EXPECT_EQ(copied, Total(kReplicatedSizes));
  ASSERT_EQ(store_->LatestCommitted(0), 2);
  for (uint32_t rank = 0; rank < 3; ++rank) ExpectRestores(rank, 2);
}

TEST_F(ReplicaGroupStoreTest, AGroupOfOneCopiesAndRestoresTheWholeStateAsWithoutAGroup) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal, 8 << 20));
  ASSERT_NO_FATAL_FAILURE(ConnectSized(0, kReplicatedSizes, GroupOf({0})));
  ASSERT_NO_FATAL_FAILURE(ConnectSized(1, kReplicatedSizes));
  EXPECT_EQ(TakeReplicated(0, 1), Total(kReplicatedSizes));
  EXPECT_EQ(TakeReplicated(1, 1), Total(kReplicatedSizes));
  EXPECT_EQ(store_->LatestCommitted(0), 1);
  ExpectRestores(0, 1);
  ExpectRestores(1, 1);
}

TEST_F(ReplicaGroupStoreTest, MoreMembersThanAlignmentUnitsLeavesSomeWithNothingToCopy) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal, 8 << 20));
  const std::vector<uint64_t> tiny{100, 3000};
  for (uint32_t rank = 0; rank < 4; ++rank) {
    ASSERT_NO_FATAL_FAILURE(ConnectSized(rank, tiny, GroupOf({0, 1, 2, 3})));
  }
  uint64_t copied = 0;
  for (uint32_t rank = 0; rank < 4; ++rank) copied += TakeReplicated(rank, 1);
  EXPECT_EQ(copied, 3100u);
  ASSERT_EQ(store_->LatestCommitted(0), 1);
  for (uint32_t rank = 0; rank < 4; ++rank) {
    Trainer& trainer = trainers_.at(rank);
    std::memset(trainer.data, 0, trainer.bytes);
    ASSERT_OK(store_->Restore(rank, std::nullopt, {}, absl::Now() + absl::Seconds(30)));
    EXPECT_TRUE(HoldsReplicated(rank, 1));
  }
}

TEST_F(ReplicaGroupStoreTest, InACommitRoundTheImageCarriesPiecesAndAMissingShardIsNamed) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 8 << 20));
  // Ranks 0 and 1 here; rank 5, the third member, snapshots on another node.
  for (uint32_t rank = 0; rank < 2; ++rank) {
    ASSERT_NO_FATAL_FAILURE(ConnectSized(rank, kReplicatedSizes, GroupOf({0, 1, 5})));
  }
  for (uint32_t rank = 0; rank < 2; ++rank) TakeReplicated(rank, 1);
  absl::StatusOr<NodeImage> image = store_->WaitNodeCaptured(1, absl::Now() + absl::Seconds(30));
  ASSERT_OK(image);
  uint64_t image_bytes = 0;
  for (const v1::ImageRegion& region : image->manifest().regions()) {
    EXPECT_TRUE(region.has_piece());
    EXPECT_EQ(region.piece().replica_group(), "data-parallel");
    image_bytes += region.bytes();
  }
  EXPECT_EQ(image_bytes, ShardStart(Total(kReplicatedSizes), 3, 2));  // shards 0 and 1
  v1::JournalCluster record;
  record.set_committed_step(1);
  ASSERT_OK(store_->CommitNodeStep(1, record, {}));
  const absl::StatusOr<v1::RestoreResponse> restored =
      store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30));
  ASSERT_STATUS(restored, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(restored.status().message(), "rank 5")) << restored.status();

  // With a caller to fetch them, the restore writes the pieces held here and lists every region
  // (this node cannot tell which ones rank 5's shard reaches); its pieces, fetched as another node
  // gives them (the same bytes: rank 1's replica; none for a region its shard misses), complete
  // every region.
  Trainer& trainer = trainers_.at(0);
  std::memset(trainer.data, 0, trainer.bytes);
  std::vector<GroupRegion> remote;
  absl::StatusOr<v1::RestoreResponse> partial =
      store_->Restore(0, std::nullopt, {}, absl::Now() + absl::Seconds(30), &remote);
  ASSERT_OK(partial);
  const uint64_t held_here = ShardStart(Total(kReplicatedSizes), 3, 2);
  EXPECT_EQ(trainer.data[held_here - 1], trainers_.at(1).data[held_here - 1]);
  EXPECT_EQ(trainer.data[held_here], 0);
  std::vector<uint64_t> starts{0};
  for (uint64_t size : kReplicatedSizes) starts.push_back(starts.back() + size);
  const std::vector<ShardPiece> fifth = ShardPieces(kReplicatedSizes, 3, 2);
  ASSERT_EQ(remote.size(), kReplicatedSizes.size());
  for (const GroupRegion& region : remote) {
    EXPECT_EQ(region.remote_members, std::vector<uint32_t>{5});
  }
  const absl::Status fetched = FetchRemotePieces(
      remote,
      [&](uint32_t member, const std::vector<std::string>& names) {
        EXPECT_EQ(member, 5u);
        v1::RestoreResponse response;
        for (const std::string& name : names) {
          const size_t i = name.back() - '0';
          if (fifth[i].bytes == 0) continue;
          const uint64_t at = starts[i] + fifth[i].offset;
          std::memcpy(trainer.data + at, trainers_.at(1).data + at, fifth[i].bytes);
          v1::RegionPiece piece;
          piece.set_replica_group("data-parallel");
          piece.set_offset(fifth[i].offset);
          piece.set_region_bytes(kReplicatedSizes[i]);
          AddRestored(*response.mutable_restored(), name, 1, fifth[i].bytes, &piece);
        }
        return absl::StatusOr<v1::RestoreResponse>(response);
      },
      &*partial);
  ASSERT_OK(fetched);
  EXPECT_TRUE(HoldsReplicated(0, 1));
  absl::StatusOr<std::vector<RestoredRegionView>> assembled = ReadRestored(partial->restored());
  ASSERT_OK(assembled);
  for (const RestoredRegionView& region : *assembled) EXPECT_EQ(region.step, 1) << region.name;
}

// A third node beside two nodes of data-parallel ranks holds only parity: with no trainer
// registered it takes part in a step when configured so, and waits for one otherwise.
TEST_F(StoreTest, ANodeWithoutTrainersTakesPartInStepsOnlyWhenParityOnly) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster));
  ASSERT_STATUS(store_->WaitNodeCaptured(1, absl::Now() + absl::Milliseconds(100)),
                absl::StatusCode::kDeadlineExceeded);
  store_.reset();
  journal_.reset();
  pool_.reset();
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 4 << 20, {.parity_only = true}));
  EXPECT_EQ(store_->CaptureOf(1), NodeCapture::kCaptured);
  absl::StatusOr<NodeImage> image = store_->WaitNodeCaptured(1, absl::Now() + absl::Seconds(30));
  ASSERT_OK(image);
  EXPECT_EQ(image->manifest().regions_size(), 0);
  v1::JournalCluster record;
  record.set_committed_step(1);
  ASSERT_OK(store_->CommitNodeStep(1, record, {}));
  EXPECT_EQ(store_->ClusterRecord()->committed_step(), 1);
}

TEST_F(ReplicaGroupStoreTest, DeclarationsThatCannotBeCutAreRefused) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kLocal, 8 << 20));
  ASSERT_NO_FATAL_FAILURE(ConnectSized(0, kReplicatedSizes, GroupOf({0, 1})));
  // Another region naming other members of the same group.
  v1::RegionSpec odd;
  odd.set_name("odd");
  odd.set_device(v1::DEVICE_HOST);
  odd.set_bytes(4096);
  odd.mutable_handle()->set_memory(trainers_.at(0).memory);
  *odd.mutable_replica_group() = GroupOf({0, 2});
  EXPECT_STATUS(store_->RegisterRegions(0, {odd}), absl::StatusCode::kInvalidArgument);
  // (A group without the registering rank is refused before the store: request_checks_test.)
  // Sparse steps of a replica group.
  v1::SparseSlot slot;
  slot.set_window_first_step(1);
  slot.set_window_size(2);
  EXPECT_STATUS(store_->Snapshot(0, 1, {"region0"}, slot), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ReplicaGroupStoreTest, InACommitRoundAMemberWhoseTrainerDiedIsWaitedFor) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 8 << 20));
  for (uint32_t rank = 0; rank < 2; ++rank) {
    ASSERT_NO_FATAL_FAILURE(ConnectSized(rank, kReplicatedSizes, GroupOf({0, 1})));
    TakeReplicated(rank, 1);
  }
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  // Rank 1's trainer dies; rank 0 takes step 2 alone. Without rank 1's shard the step would
  // leave the group's pieces at two steps: the node does not report it captured.
  store_->EndSession(1, trainers_.at(1).session);
  TakeReplicated(0, 2);
  const absl::StatusOr<NodeImage> without =
      store_->WaitNodeCaptured(2, absl::Now() + absl::Milliseconds(300));
  ASSERT_STATUS(without, absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(without.status().message(), "[1]")) << without.status();
  // The job restarts with rank 0 alone: rank 1 is no member any more, and the steps commit.
  ASSERT_NO_FATAL_FAILURE(ConnectSized(0, kReplicatedSizes, GroupOf({0})));
  ExpectRestores(0, 1);
  TakeReplicated(0, 3);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(3));
  ExpectRestores(0, 3);
}

// A step the cluster aborted stays in a rank's records after a later step committed; the job then
// restarts with one more member, so the rank's shard no longer reaches regions that step copied.
// The committed step after it covered its changes: the rank's next steps, which leave those regions
// out (another member holds them now), are consistent and commit.
TEST_F(ReplicaGroupStoreTest, AnAbortedStepBeforeTheCommittedOneDoesNotHoldStepsOfANewLayout) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 8 << 20));
  for (uint32_t rank = 0; rank < 2; ++rank) {
    ASSERT_NO_FATAL_FAILURE(ConnectSized(rank, kReplicatedSizes, GroupOf({0, 1})));
    TakeReplicated(rank, 1);
  }
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(1));
  for (uint32_t rank = 0; rank < 2; ++rank) TakeReplicated(rank, 2);
  store_->AbortNodeStep(2, absl::AbortedError("a node did not prepare"));
  for (uint32_t rank = 0; rank < 2; ++rank) TakeReplicated(rank, 3);
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(3));
  // Rank 1's half reaches the last regions; its third, in a group of three, does not.
  const std::vector<ShardPiece> half = ShardPieces(kReplicatedSizes, 2, 1);
  const std::vector<ShardPiece> third = ShardPieces(kReplicatedSizes, 3, 1);
  ASSERT_GT(half.back().bytes, 0u);
  ASSERT_EQ(third.back().bytes, 0u);
  const v1::ReplicaGroup three = GroupOf({0, 1, 2});
  for (uint32_t rank = 0; rank < 2; ++rank) {
    ASSERT_NO_FATAL_FAILURE(ConnectSized(rank, kReplicatedSizes, three));
    ExpectRestores(rank, 3);
  }
  ASSERT_NO_FATAL_FAILURE(ConnectSized(2, kReplicatedSizes, three));
  for (int64_t step = 4; step <= 5; ++step) {
    for (uint32_t rank = 0; rank < 3; ++rank) TakeReplicated(rank, step);
    ASSERT_NO_FATAL_FAILURE(CommitInCluster(step));
  }
  for (uint32_t rank = 0; rank < 3; ++rank) ExpectRestores(rank, 5);
}

// A job that snapshots every few steps dies with step 20 captured and not committed; it restarts
// as a group of three from step 10 and, snapshotting at other step numbers, never takes step 20
// again. Step 20 belongs to the timeline the restore ended: its regions were restored to step 10,
// so a later step of the smaller shard is not held to them.
TEST_F(ReplicaGroupStoreTest, AStepOfATimelineARestoreEndedDoesNotHoldLaterSteps) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 8 << 20));
  for (uint32_t rank = 0; rank < 2; ++rank) {
    ASSERT_NO_FATAL_FAILURE(ConnectSized(rank, kReplicatedSizes, GroupOf({0, 1})));
    TakeReplicated(rank, 10);
  }
  ASSERT_NO_FATAL_FAILURE(CommitInCluster(10));
  for (uint32_t rank = 0; rank < 2; ++rank) TakeReplicated(rank, 20);  // the job dies here
  ASSERT_EQ(ShardPieces(kReplicatedSizes, 3, 1).back().bytes, 0u);
  const v1::ReplicaGroup three = GroupOf({0, 1, 2});
  for (uint32_t rank = 0; rank < 2; ++rank) {
    ASSERT_NO_FATAL_FAILURE(ConnectSized(rank, kReplicatedSizes, three));
    ExpectRestores(rank, 10);
  }
  ASSERT_NO_FATAL_FAILURE(ConnectSized(2, kReplicatedSizes, three));
  for (int64_t step : {15, 25}) {
    for (uint32_t rank = 0; rank < 3; ++rank) TakeReplicated(rank, step);
    ASSERT_NO_FATAL_FAILURE(CommitInCluster(step));
  }
  for (uint32_t rank = 0; rank < 3; ++rank) ExpectRestores(rank, 25);
}

// A member of a replica group whose trainer leaves before its first step holds nothing of its own,
// yet the group's step cannot commit without its shard: the node remembers it while a trainer here
// declares the group or a step of the group waits for its decision, even once every trainer is
// gone, and forgets it after.
TEST_F(ReplicaGroupStoreTest, AMemberThatLeftBeforeItsFirstStepHoldsTheGroupsStepBackUntilDecided) {
  ASSERT_NO_FATAL_FAILURE(Open(CommitMode::kCluster, 8 << 20));
  for (uint32_t rank = 0; rank < 2; ++rank) {
    ASSERT_NO_FATAL_FAILURE(ConnectSized(rank, kReplicatedSizes, GroupOf({0, 1})));
  }
  store_->EndSession(1, trainers_.at(1).session);
  TakeReplicated(0, 1);
  absl::StatusOr<NodeImage> without =
      store_->WaitNodeCaptured(1, absl::Now() + absl::Milliseconds(300));
  ASSERT_STATUS(without, absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(without.status().message(), "[1]")) << without.status();
  store_->EndSession(0, trainers_.at(0).session);
  without = store_->WaitNodeCaptured(1, absl::Now() + absl::Milliseconds(300));
  ASSERT_STATUS(without, absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(without.status().message(), "ranks [1] known here"))
      << without.status();
  EXPECT_EQ(store_->Status().ranks(), 2u);
  // The cluster aborts the step: nothing waits for rank 1 any more, and the next process that
  // leaves takes it along.
  store_->AbortNodeStep(1, absl::AbortedError("a node did not prepare"));
  ASSERT_NO_FATAL_FAILURE(Connect(5));
  store_->EndSession(5, trainers_.at(5).session);
  EXPECT_EQ(store_->Status().ranks(), 1u);
}

}  // namespace
}  // namespace moesnap::daemon
