// moesnapctl export without a daemon: safetensors headers as the format describes them (dtype
// names, shapes, data offsets that cover the data back to back, each tensor aligned to its element
// size), and the export writer fed a stream: files appear only once every chunk arrived with its
// CRC-32C, and a stream out of order, short or corrupt fails naming the region.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "client/ctl/durable_format.h"
#include "client/ctl/export.h"
#include "client/ctl/safetensors.h"
#include "erasure/crc32c.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::ctl {
namespace {

uint64_t HeaderLength(const std::string& header) {
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= uint64_t{static_cast<uint8_t>(header[i])} << (8 * i);
  return length;
}

TEST(SafetensorsTest, DtypesAreSpelledAsTheFormatDoes) {
  EXPECT_EQ(SafetensorsDtypeOf("torch.float32")->name, "F32");
  EXPECT_EQ(SafetensorsDtypeOf("torch.bfloat16")->name, "BF16");
  EXPECT_EQ(SafetensorsDtypeOf("torch.bfloat16")->element_bytes, 2u);
  EXPECT_EQ(SafetensorsDtypeOf("int64")->name, "I64");
  EXPECT_EQ(SafetensorsDtypeOf("bool")->name, "BOOL");
  EXPECT_EQ(SafetensorsDtypeOf("U8")->name, "U8");
  EXPECT_EQ(SafetensorsDtypeOf("torch.float8_e4m3fn")->name, "F8_E4M3");
  EXPECT_FALSE(SafetensorsDtypeOf("pickle").has_value());
  EXPECT_FALSE(SafetensorsDtypeOf("").has_value());
}

TEST(SafetensorsTest, HeaderIsPaddedJsonAndDataIsAlignedAndContiguous) {
  const SafetensorsLayout layout = LayOutSafetensors(
      {{"b.bias", {"F16", 2}, {3}, 6}, {"a.weight", {"F32", 4}, {2, 2}, 16}, {"flag", {"BOOL", 1}, {1}, 1},
       {"empty", {"F32", 4}, {0, 4}, 0}},
      {{"format", "pt"}, {"quote\"d", "x"}});
  const uint64_t json_bytes = HeaderLength(layout.header);
  EXPECT_EQ(layout.header.size(), 8 + json_bytes);
  EXPECT_EQ(layout.header.size() % 8, 0u);
  const std::string json = layout.header.substr(8);
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.find_first_not_of(' ', json.rfind('}') + 1), std::string::npos);  // spaces only
  EXPECT_NE(json.find("\"__metadata__\":{\"format\":\"pt\",\"quote\\\"d\":\"x\"}"), std::string::npos) << json;
  // Larger elements first, then by name: a.weight [0,16), empty [16,16), b.bias [16,22), flag [22,23).
  EXPECT_NE(json.find("\"a.weight\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}"),
            std::string::npos) << json;
  EXPECT_NE(json.find("\"empty\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[16,16]}"),
            std::string::npos) << json;
  EXPECT_NE(json.find("\"b.bias\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[16,22]}"),
            std::string::npos) << json;
  EXPECT_NE(json.find("\"flag\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[22,23]}"),
            std::string::npos) << json;
  EXPECT_EQ(layout.offsets.at("b.bias"), layout.header.size() + 16);
  EXPECT_EQ(layout.file_bytes, layout.header.size() + 23);
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char folder[] = "/tmp/moesnap-export-XXXXXX";
    directory_ = mkdtemp(folder);
    // Rank 0: a float32 tensor of 3 chunks of 4096 bytes (the last short) and a pickled state.
    weights_.resize(10000);
    for (size_t i = 0; i < weights_.size(); ++i) weights_[i] = static_cast<char>(i * 7);
    pickle_ = std::string("\x05\0\0\0\0\0\0\0hello", 13);
    header_.set_step(12);
    header_.set_tier(v1::TIER_MEMORY);
    AddRegion("model.weight", "torch.float32", {2500}, weights_);
    AddRegion("data", "pickle", {}, pickle_);
    header_.set_bytes(weights_.size() + pickle_.size());
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }

  void AddRegion(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                 const std::string& bytes) {
    v1::ImageRegion* region = header_.add_regions();
    region->set_region(name);
    region->set_dtype(dtype);
    for (int64_t dimension : shape) region->add_shape(dimension);
    region->set_bytes(bytes.size());
    region->set_chunk_bytes(4096);
    region->set_step(12);
    for (size_t offset = 0; offset < bytes.size(); offset += 4096) {
      region->add_chunk_crcs(erasure::Crc32c(bytes.data() + offset, std::min<size_t>(4096, bytes.size() - offset)));
    }
  }
  // The region's bytes in pieces of `piece` that never cross a chunk.
  std::vector<v1::ExportData> Pieces(uint32_t region, const std::string& bytes, size_t piece) {
    std::vector<v1::ExportData> pieces;
    for (size_t chunk = 0; chunk < bytes.size(); chunk += 4096) {
      const size_t end = std::min<size_t>(chunk + 4096, bytes.size());
      for (size_t offset = chunk; offset < end; offset += piece) {
        v1::ExportData data;
        data.set_region(region);
        data.set_offset(offset);
        data.set_data(bytes.substr(offset, std::min(piece, end - offset)));
        pieces.push_back(data);
      }
    }
    return pieces;
  }
  std::string Read(const std::string& name) {
    std::stringstream text;
    text << std::ifstream(directory_ + "/" + name, std::ios::binary).rdbuf();
    return text.str();
  }

  std::string directory_;
  std::string weights_;
  std::string pickle_;
  v1::ExportHeader header_;
};

TEST_F(ExportTest, TensorsAndOtherRegionsLandInTheirFilesWithAnIndex) {
  absl::StatusOr<std::unique_ptr<SafetensorsExport>> files = SafetensorsExport::Begin(directory_, header_);
  ASSERT_OK(files);
  for (const v1::ExportData& data : Pieces(0, weights_, 1000)) ASSERT_OK((*files)->Add(data));
  for (const v1::ExportData& data : Pieces(1, pickle_, 1000)) ASSERT_OK((*files)->Add(data));
  EXPECT_FALSE(std::filesystem::exists(directory_ + "/rank-0.safetensors"));  // not before Finish
  ASSERT_OK((*files)->Finish());
  EXPECT_EQ((*files)->bytes_received(), header_.bytes());
  const std::string tensors = Read("rank-0.safetensors");
  const uint64_t json = HeaderLength(tensors);
  EXPECT_EQ(tensors.substr(8 + json), weights_);
  EXPECT_NE(tensors.find("\"model.weight\":{\"dtype\":\"F32\",\"shape\":[2500]"), std::string::npos);
  const std::string others = Read("rank-0.other.safetensors");
  EXPECT_EQ(others.substr(8 + HeaderLength(others)), pickle_);
  EXPECT_NE(others.find("\"data\":{\"dtype\":\"U8\",\"shape\":[13]"), std::string::npos);
  const std::string index = Read(kExportIndexName);
  EXPECT_NE(index.find("\"format\":\"moesnap-export\""), std::string::npos) << index;
  EXPECT_NE(index.find("\"data\":{\"file\":\"rank-0.other.safetensors\",\"kind\":\"bytes\","
                       "\"dtype\":\"pickle\""), std::string::npos) << index;
  EXPECT_EQ((*files)->files(), (std::vector<std::string>{"rank-0.safetensors",
                                                         "rank-0.other.safetensors", "index.json"}));
}

TEST_F(ExportTest, ACorruptChunkFailsAndLeavesNoFile) {
  absl::StatusOr<std::unique_ptr<SafetensorsExport>> files = SafetensorsExport::Begin(directory_, header_);
  ASSERT_OK(files);
  std::vector<v1::ExportData> pieces = Pieces(0, weights_, 4096);
  (*pieces[1].mutable_data())[17] ^= 1;
  ASSERT_OK((*files)->Add(pieces[0]));
  const absl::Status corrupt = (*files)->Add(pieces[1]);
  ASSERT_STATUS(corrupt, absl::StatusCode::kDataLoss);
  EXPECT_NE(corrupt.message().find("'model.weight' of rank 0, chunk 1"), std::string::npos) << corrupt;
  files->reset();
  EXPECT_TRUE(std::filesystem::is_empty(directory_));
}

TEST_F(ExportTest, PiecesOutOfOrderAcrossChunksOrMissingAreRefused) {
  absl::StatusOr<std::unique_ptr<SafetensorsExport>> files = SafetensorsExport::Begin(directory_, header_);
  ASSERT_OK(files);
  const std::vector<v1::ExportData> pieces = Pieces(0, weights_, 4096);
  EXPECT_STATUS((*files)->Add(pieces[1]), absl::StatusCode::kDataLoss);  // before chunk 0
  v1::ExportData straddling;
  straddling.set_region(0);
  straddling.set_offset(0);
  straddling.set_data(weights_.substr(0, 5000));  // across the end of chunk 0
  EXPECT_STATUS((*files)->Add(straddling), absl::StatusCode::kDataLoss);
  v1::ExportData unknown = pieces[0];
  unknown.set_region(7);
  EXPECT_STATUS((*files)->Add(unknown), absl::StatusCode::kDataLoss);
  ASSERT_OK((*files)->Add(pieces[0]));
  EXPECT_STATUS((*files)->Finish(), absl::StatusCode::kDataLoss);  // chunks 1, 2 and "data" missing
}

TEST(DurableFormatTest, StatusLineSaysWhatIsDurableAndWhyADrainFails) {
  v1::DurableStatus durable;
  EXPECT_EQ(DescribeDurable(durable), "off");
  durable.set_enabled(true);
  EXPECT_EQ(DescribeDurable(durable), "no step durable yet");
  durable.set_latest_step(4);
  durable.set_last_error("drain of step 6 failed: No space left on device");
  EXPECT_EQ(DescribeDurable(durable),
            "step 4 durable; FAILING: drain of step 6 failed: No space left on device");
  v1::ListDurableResponse list;
  *list.mutable_status() = durable;
  list.set_newest_everywhere(4);
  v1::DurableStepInfo* step = list.add_steps();
  step->set_step(4);
  step->set_bytes(2 << 20);
  step->set_created_unix_ms(1000);
  step->add_ranks(0);
  step->set_regions(3);
  step->set_durable_everywhere(true);
  const std::string table = FormatDurableList(list, 1000 + 90'000);
  EXPECT_NE(table.find("newest step durable on every node: 4"), std::string::npos) << table;
  EXPECT_NE(table.find("90 s"), std::string::npos) << table;
  EXPECT_NE(table.find("newest on every node"), std::string::npos) << table;
}

}  // namespace
}  // namespace moesnap::ctl
