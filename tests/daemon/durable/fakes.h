// Fakes at the durable tier's seams: a clock the test moves, a store whose committed image the
// test sets, a job view whose peers and records the test scripts, and a pool for real extents
// (testing::TestPool).
#ifndef MOESNAP_TESTS_DAEMON_DURABLE_FAKES_H_
#define MOESNAP_TESTS_DAEMON_DURABLE_FAKES_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "daemon/durable/clock.h"
#include "daemon/durable/job_view.h"
#include "daemon/durable_store.h"
#include "daemon/pool.h"
#include "erasure/crc32c.h"
#include "tests/testing/deterministic_bytes.h"
#include "tests/testing/test_pool.h"

namespace moesnap::daemon::durable {

// Time moves only when someone sleeps (or the test advances it); with `hold` set, sleepers wait
// until the test releases them, so a drain can be kept in the middle of its write.
class FakeClock final : public Clock {
 public:
  absl::Time Now() override {
    absl::MutexLock lock(&mutex_);
    return now_;
  }
  void SleepFor(absl::Duration duration) override {
    absl::MutexLock lock(&mutex_);
    ++sleepers_;
    mutex_.Await(absl::Condition(+[](bool* hold) { return !*hold; }, &hold_));
    --sleepers_;
    now_ += duration;
    slept_ += duration;
  }
  void Advance(absl::Duration duration) {
    absl::MutexLock lock(&mutex_);
    now_ += duration;
  }
  void Hold(bool hold) {
    absl::MutexLock lock(&mutex_);
    hold_ = hold;
  }
  // Waits until a sleeper is held.
  void AwaitSleeper() {
    absl::MutexLock lock(&mutex_);
    mutex_.Await(absl::Condition(+[](int* sleepers) { return *sleepers > 0; }, &sleepers_));
  }
  absl::Duration slept() {
    absl::MutexLock lock(&mutex_);
    return slept_;
  }

 private:
  absl::Mutex mutex_;
  absl::Time now_ = absl::FromUnixSeconds(1'000'000'000);
  absl::Duration slept_;
  bool hold_ = false;
  int sleepers_ = 0;
};

using testing::TestPool;

// An image of `regions` (rank, name, bytes) filled with bytes that depend on `seed`, with the
// chunk CRCs a capture would have recorded.
inline NodeImage MakeImage(Pool* pool, const std::vector<std::tuple<uint32_t, std::string, uint64_t>>& regions,
                           uint64_t seed, uint64_t chunk_bytes = 4096, int64_t step = 1) {
  v1::NodeImage manifest;
  manifest.set_step(step);
  std::map<uint32_t, bool> ranks;
  for (const auto& [rank, name, bytes] : regions) {
    v1::ImageRegion* region = manifest.add_regions();
    region->set_rank(rank);
    region->set_region(name);
    region->set_step(step);
    region->set_bytes(bytes);
    region->set_dtype("float32");
    region->add_shape(static_cast<int64_t>(bytes / 4));
    region->set_chunk_bytes(chunk_bytes);
    ranks[rank] = true;
  }
  for (const auto& [rank, unused] : ranks) {
    v1::JournalRank* record = manifest.add_ranks();
    record->set_rank(rank);
    record->set_latest_committed_step(step);
  }
  NodeImage image = *NodeImage::Allocate(pool, manifest);
  v1::NodeImage filled = image.manifest();
  for (int i = 0; i < filled.regions_size(); ++i) {
    v1::ImageRegion* region = filled.mutable_regions(i);
    std::vector<uint8_t> bytes(region->bytes());
    moesnap::testing::DeterministicBytes(seed * 1000 + i).Fill(bytes.data(), bytes.size());
    image.stored()[i]->Write(0, bytes.data(), bytes.size());
    for (uint64_t offset = 0; offset < region->bytes(); offset += chunk_bytes) {
      region->add_chunk_crcs(
          erasure::Crc32c(bytes.data() + offset, std::min(chunk_bytes, region->bytes() - offset)));
    }
  }
  return NodeImage(filled, image.stored());
}

// The bytes of region `region` of an image.
inline std::vector<uint8_t> RegionBytes(const NodeImage& image, int region) {
  std::vector<uint8_t> bytes(image.manifest().regions(region).bytes());
  image.stored()[region]->Read(0, bytes.size(), bytes.data());
  return bytes;
}

// The store as the durable tier sees it: the test sets the committed image and tells the
// observer of commits; what is loaded from disk is kept as bytes per region.
class FakeDurableStore final : public DurableStore {
 public:
  void SetCommitObserver(CommitObserver* observer) override {
    absl::MutexLock lock(&mutex_);
    observer_ = observer;
  }
  NodeImage CommittedImage() const override {
    absl::MutexLock lock(&mutex_);
    return image_;
  }
  absl::Status AdoptCommitted(uint32_t rank, const std::vector<v1::ImageRegion>& regions,
                              const v1::JournalRank& record, const ChunkSource& read) override {
    std::map<std::string, std::vector<uint8_t>> loaded;
    for (size_t i = 0; i < regions.size(); ++i) {
      std::vector<uint8_t>& bytes = loaded[regions[i].region()];
      bytes.resize(regions[i].bytes() + regions[i].chunk_bytes());  // room for a whole last chunk
      for (int chunk = 0; chunk < regions[i].chunk_crcs_size(); ++chunk) {
        if (absl::Status status = read(static_cast<int>(i), static_cast<uint32_t>(chunk),
                                       bytes.data() + uint64_t(chunk) * regions[i].chunk_bytes());
            !status.ok()) {
          return status;
        }
      }
      bytes.resize(regions[i].bytes());
    }
    absl::MutexLock lock(&mutex_);
    adopted_[rank] = std::move(loaded);
    records_[rank] = record;
    return absl::OkStatus();
  }

  // A commit of `step` after `previous` with `image` as the committed image.
  void Commit(std::optional<int64_t> previous, int64_t step, NodeImage image) {
    absl::MutexLock lock(&mutex_);
    image_ = std::move(image);
    if (observer_ != nullptr) {
      observer_->Committed(previous, step, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return image_; });
    }
  }
  // The bytes adopted for a rank's region, and the rank's record.
  std::map<std::string, std::vector<uint8_t>> Adopted(uint32_t rank) {
    absl::MutexLock lock(&mutex_);
    return adopted_[rank];
  }
  std::optional<v1::JournalRank> Record(uint32_t rank) {
    absl::MutexLock lock(&mutex_);
    auto it = records_.find(rank);
    return it == records_.end() ? std::nullopt : std::optional<v1::JournalRank>(it->second);
  }
  bool observed() {
    absl::MutexLock lock(&mutex_);
    return observer_ != nullptr;
  }

 private:
  mutable absl::Mutex mutex_;
  CommitObserver* observer_ = nullptr;
  NodeImage image_;
  std::map<uint32_t, std::map<std::string, std::vector<uint8_t>>> adopted_;
  std::map<uint32_t, v1::JournalRank> records_;
};

// Peers and the job's records as the test scripts them; what this node recorded is kept.
class FakeJobView final : public JobView {
 public:
  absl::Status WaitMemory(absl::Time) override { return memory; }
  MemorySurvey SurveyMemory(absl::Time) override { return peers; }
  absl::StatusOr<DurableEverywhere> NewestDurableEverywhere(const std::vector<int64_t>&) override {
    absl::MutexLock lock(&mutex_);
    return everywhere;
  }
  absl::Status RecordDurable(const std::vector<int64_t>& here) override {
    absl::MutexLock lock(&mutex_);
    if (record_failure.ok()) recorded_.push_back(here);
    return record_failure;
  }
  void StateLoaded() override {}
  // Every record this node wrote, in order.
  std::vector<std::vector<int64_t>> Recorded() {
    absl::MutexLock lock(&mutex_);
    return recorded_;
  }

  absl::Status memory;
  MemorySurvey peers;
  absl::StatusOr<DurableEverywhere> everywhere = DurableEverywhere{};
  absl::Status record_failure;

 private:
  absl::Mutex mutex_;
  std::vector<std::vector<int64_t>> recorded_;
};

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_TESTS_DAEMON_DURABLE_FAKES_H_
