// A node image written as a step folder and read back: bytes and layout survive; nothing is
// listed before it is complete; corrupt, truncated or foreign files are refused on read; a
// corrupt pool, a folder that cannot be written and a stop leave no step behind.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "daemon/durable/durable_directory.h"
#include "daemon/durable/manifest.h"
#include "daemon/durable/step_reader.h"
#include "daemon/durable/step_writer.h"
#include "tests/daemon/durable/fakes.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::durable {
namespace {

class StepFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char root[] = "/tmp/moesnap-durable-XXXXXX";
    root_ = mkdtemp(root);
    directory_ = std::make_unique<DurableDirectory>(root_, 5);
    ASSERT_OK(directory_->Create());
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  absl::StatusOr<WrittenStep> Write(int64_t step, const NodeImage& image,
                                    const std::atomic<bool>& stop = std::atomic<bool>(false)) {
    std::atomic<uint64_t> written{0};
    return WriteStep(*directory_, step, image, {5, 0, {}, 1}, {}, &clock_, &written, stop);
  }

  std::string root_;
  std::unique_ptr<DurableDirectory> directory_;
  TestPool pool_;
  FakeClock clock_;
};

TEST_F(StepFilesTest, EveryChunkReadsBackAsWritten) {
  // Two ranks, regions of odd sizes so that offsets need alignment and chunks end short.
  const NodeImage image = MakeImage(pool_.get(), {{0, "a", 10000}, {0, "b", 4096}, {2, "c", 1}}, 1);
  absl::StatusOr<WrittenStep> written = Write(7, image);
  ASSERT_OK(written);
  EXPECT_EQ(*directory_->Steps(), std::vector<int64_t>({7}));
  absl::StatusOr<std::unique_ptr<StepReader>> reader = StepReader::Open(*directory_, 7);
  ASSERT_OK(reader);
  const v1::DurableManifest& manifest = (*reader)->manifest();
  EXPECT_EQ(manifest.node_id(), 5u);
  EXPECT_EQ(manifest.step(), 7);
  ASSERT_EQ(manifest.regions_size(), 3);
  EXPECT_EQ(manifest.regions(1).offset() % kRegionAlignment, 0u);
  EXPECT_EQ(manifest.ranks_size(), 2);
  for (int i = 0; i < 3; ++i) {
    const v1::ImageRegion& region = manifest.regions(i).region();
    EXPECT_EQ(region.region(), image.manifest().regions(i).region());
    const std::vector<uint8_t> expected = RegionBytes(image, i);
    for (int chunk = 0; chunk < region.chunk_crcs_size(); ++chunk) {
      std::vector<uint8_t> bytes(region.chunk_bytes());
      ASSERT_OK((*reader)->ReadChunk(i, chunk, bytes.data()));
      const uint64_t offset = uint64_t(chunk) * region.chunk_bytes();
      EXPECT_EQ(0, std::memcmp(bytes.data(), expected.data() + offset,
                               std::min(region.chunk_bytes(), region.bytes() - offset)));
    }
  }
  EXPECT_STATUS((*reader)->Find(0, "nope"), absl::StatusCode::kNotFound);
  EXPECT_STATUS((*reader)->ReadChunk(0, 3, nullptr), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(*directory_->StepBytes(7), written->bytes);
}

TEST_F(StepFilesTest, CorruptTruncatedOrForeignFilesAreRefused) {
  const NodeImage image = MakeImage(pool_.get(), {{0, "a", 10000}}, 2);
  ASSERT_OK(Write(3, image));
  const std::string data = directory_->StepPath(3) + "/" + DataFileName(0);
  {
    std::fstream file(data, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(5000);
    file.put('\x5a' ^ static_cast<char>(RegionBytes(image, 0)[5000]));
  }
  absl::StatusOr<std::unique_ptr<StepReader>> reader = StepReader::Open(*directory_, 3);
  ASSERT_OK(reader);
  std::vector<uint8_t> bytes(4096);
  EXPECT_OK((*reader)->ReadChunk(0, 0, bytes.data()));
  EXPECT_STATUS((*reader)->ReadChunk(0, 1, bytes.data()), absl::StatusCode::kDataLoss);
  reader->reset();
  ASSERT_EQ(truncate(data.c_str(), 9000), 0);
  EXPECT_STATUS(StepReader::Open(*directory_, 3), absl::StatusCode::kDataLoss);
  // A step folder renamed to another step describes another step.
  ASSERT_OK(Write(4, image));
  std::filesystem::rename(directory_->StepPath(4), directory_->StepPath(9));
  EXPECT_STATUS(StepReader::Open(*directory_, 9), absl::StatusCode::kDataLoss);
  // A manifest that is not one.
  std::ofstream(directory_->StepPath(9) + "/" + kManifestFileName) << "not a manifest";
  EXPECT_STATUS(StepReader::Open(*directory_, 9), absl::StatusCode::kDataLoss);
}

TEST_F(StepFilesTest, ACorruptPoolIsNeverMadeDurable) {
  NodeImage image = MakeImage(pool_.get(), {{0, "a", 10000}}, 3);
  const uint8_t flipped = RegionBytes(image, 0)[9000] ^ 1;
  image.stored()[0]->Write(9000, &flipped, 1);  // after the capture recorded its CRC
  absl::StatusOr<WrittenStep> written = Write(5, image);
  EXPECT_STATUS(written, absl::StatusCode::kDataLoss);
  EXPECT_TRUE(directory_->Steps()->empty());
  EXPECT_EQ(*directory_->RemoveLeftovers(), 0);  // the partial folder is gone already
}

TEST_F(StepFilesTest, AStoppedWriteLeavesNothingAndTheStepsBeforeItStay) {
  const NodeImage image = MakeImage(pool_.get(), {{0, "a", 100000}}, 4);
  ASSERT_OK(Write(1, image));
  std::atomic<bool> stop{true};
  EXPECT_STATUS(Write(2, image, stop), absl::StatusCode::kCancelled);
  EXPECT_EQ(*directory_->Steps(), std::vector<int64_t>({1}));
  EXPECT_OK(StepReader::Open(*directory_, 1));
}

TEST_F(StepFilesTest, AFolderThatCannotBeWrittenFailsTheDrainAndSaysWhere) {
  const NodeImage image = MakeImage(pool_.get(), {{0, "a", 1000}}, 5);
  // A file where the node folder should be: no step folder can be made under it.
  std::filesystem::remove_all(directory_->path());
  std::ofstream(directory_->path()) << "in the way";
  absl::StatusOr<WrittenStep> written = Write(1, image);
  ASSERT_FALSE(written.ok());
  EXPECT_NE(written.status().message().find(directory_->path()), std::string::npos)
      << written.status();
}

TEST_F(StepFilesTest, ListingShowsCompleteStepsOnlyAndPublishingReplacesAnAbandonedOne) {
  const NodeImage first = MakeImage(pool_.get(), {{0, "a", 5000}}, 6);
  const NodeImage second = MakeImage(pool_.get(), {{0, "a", 5000}}, 7);
  ASSERT_OK(Write(12, first));
  ASSERT_OK(directory_->CreatePartial(13));
  std::filesystem::create_directory(directory_->path() + "/step-x");
  std::filesystem::create_directory(directory_->path() + "/step-014");  // not a canonical name
  std::ofstream(directory_->path() + "/step-15") << "a file, not a folder";
  EXPECT_EQ(*directory_->Steps(), std::vector<int64_t>({12}));
  EXPECT_EQ(*directory_->RemoveLeftovers(), 1);
  // The same step written again (a run restored from an older step reached it once more).
  ASSERT_OK(Write(12, second));
  absl::StatusOr<std::unique_ptr<StepReader>> reader = StepReader::Open(*directory_, 12);
  ASSERT_OK(reader);
  EXPECT_EQ((*reader)->manifest().regions(0).region().chunk_crcs(0),
            second.manifest().regions(0).chunk_crcs(0));
  ASSERT_OK(directory_->Remove(12));
  EXPECT_TRUE(directory_->Steps()->empty());
}

}  // namespace
}  // namespace moesnap::daemon::durable
