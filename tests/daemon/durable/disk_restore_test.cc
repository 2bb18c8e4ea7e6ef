// A rank loaded from a durable step into memory: the store adopts exactly the step's bytes and
// the rank's record; a corrupt chunk on disk fails the load and nothing is adopted.
#include "daemon/durable/disk_restore.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "daemon/durable/manifest.h"
#include "daemon/durable/step_writer.h"
#include "tests/daemon/durable/fakes.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::durable {
namespace {

class DiskRestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char root[] = "/tmp/moesnap-restore-XXXXXX";
    root_ = mkdtemp(root);
    directory_ = std::make_unique<DurableDirectory>(root_, 0);
    ASSERT_OK(directory_->Create());
    image_ = MakeImage(pool_.get(), {{0, "a", 10000}, {0, "b", 300}, {1, "c", 5000}}, 9, 4096, 6);
    std::atomic<bool> stop{false};
    ASSERT_OK(WriteStep(*directory_, 6, image_, {0, 0, {}, 1}, {}, &clock_, nullptr, stop));
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  std::string root_;
  std::unique_ptr<DurableDirectory> directory_;
  TestPool pool_;
  FakeClock clock_;
  NodeImage image_;
  FakeDurableStore store_;
};

TEST_F(DiskRestoreTest, TheStoreAdoptsTheRanksRegionsAndRecord) {
  absl::StatusOr<std::unique_ptr<StepReader>> step = StepReader::Open(*directory_, 6);
  ASSERT_OK(step);
  ASSERT_OK(LoadRankFromDisk(&store_, **step, 0));
  const std::map<std::string, std::vector<uint8_t>> adopted = store_.Adopted(0);
  ASSERT_EQ(adopted.size(), 2u);  // rank 0's regions only
  EXPECT_EQ(adopted.at("a"), RegionBytes(image_, 0));
  EXPECT_EQ(adopted.at("b"), RegionBytes(image_, 1));
  ASSERT_TRUE(store_.Record(0).has_value());
  EXPECT_EQ(store_.Record(0)->latest_committed_step(), 6);
  EXPECT_STATUS(LoadRankFromDisk(&store_, **step, 4), absl::StatusCode::kNotFound);  // no rank 4
}

TEST_F(DiskRestoreTest, ACorruptChunkOnDiskFailsTheLoad) {
  {
    std::fstream file(directory_->StepPath(6) + "/" + DataFileName(1),
                      std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(4500);
    file.put('\x01' ^ static_cast<char>(RegionBytes(image_, 2)[4500]));
  }
  absl::StatusOr<std::unique_ptr<StepReader>> step = StepReader::Open(*directory_, 6);
  ASSERT_OK(step);
  const absl::Status loaded = LoadRankFromDisk(&store_, **step, 1);
  ASSERT_STATUS(loaded, absl::StatusCode::kDataLoss);
  EXPECT_NE(loaded.message().find("chunk 1"), std::string::npos) << loaded;
  EXPECT_TRUE(store_.Adopted(1).empty());
}

}  // namespace
}  // namespace moesnap::daemon::durable
