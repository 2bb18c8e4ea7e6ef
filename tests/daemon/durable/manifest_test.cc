// Manifest files read back from disk are untrusted: every header fault and every inconsistent or
// out-of-bounds record is refused with DATA_LOSS, and no corruption of the bytes crashes the
// parser or the checks.
#include "daemon/durable/manifest.h"

#include <gtest/gtest.h>

#include <limits>

#include "daemon/region_limits.h"
#include "erasure/crc32c.h"
#include "tests/testing/deterministic_bytes.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::durable {
namespace {

v1::DurableManifest TwoRegions() {
  v1::DurableManifest manifest;
  manifest.set_node_id(3);
  manifest.set_step(42);
  v1::DurableFile* file = manifest.add_files();
  file->set_rank(0);
  file->set_bytes(8192 + 5000);
  for (int i = 0; i < 2; ++i) {
    v1::DurableRegion* record = manifest.add_regions();
    record->set_offset(i == 0 ? 0 : 8192);
    v1::ImageRegion* region = record->mutable_region();
    region->set_rank(0);
    region->set_region(i == 0 ? "layer0.weight" : "layer0.bias");
    region->set_bytes(i == 0 ? 8192 : 5000);
    region->set_dtype("float32");
    region->add_shape(i == 0 ? 2048 : 1250);
    region->set_chunk_bytes(4096);
    for (int chunk = 0; chunk < 2; ++chunk) region->add_chunk_crcs(0x1234 + chunk);
  }
  v1::JournalRank* rank = manifest.add_ranks();
  rank->set_rank(0);
  rank->set_latest_committed_step(42);
  return manifest;
}

TEST(ManifestTest, RoundTripsAndPassesItsChecks) {
  const v1::DurableManifest manifest = TwoRegions();
  const std::string file = SerializeManifestFile(manifest);
  EXPECT_EQ(file.size(), kManifestHeaderBytes + manifest.ByteSizeLong());
  absl::StatusOr<v1::DurableManifest> parsed = ParseManifestFile(file, "m");
  ASSERT_OK(parsed);
  EXPECT_EQ(parsed->SerializeAsString(), manifest.SerializeAsString());
  EXPECT_OK(CheckManifest(*parsed, 3, 42));
}

TEST(ManifestTest, HeaderFaultsAreRefused) {
  const std::string good = SerializeManifestFile(TwoRegions());
  EXPECT_STATUS(ParseManifestFile(good.substr(0, 20), "m"), absl::StatusCode::kDataLoss);
  std::string magic = good;
  magic[0] = 'X';
  EXPECT_STATUS(ParseManifestFile(magic, "m"), absl::StatusCode::kDataLoss);
  std::string version = good;
  version[8] = 2;
  EXPECT_STATUS(ParseManifestFile(version, "m"), absl::StatusCode::kDataLoss);
  EXPECT_STATUS(ParseManifestFile(good + "x", "m"), absl::StatusCode::kDataLoss);     // length
  EXPECT_STATUS(ParseManifestFile(good.substr(0, good.size() - 1), "m"), absl::StatusCode::kDataLoss);
  std::string huge = good;
  huge[23] = 0x7f;  // a payload length near 2^63
  EXPECT_STATUS(ParseManifestFile(huge, "m"), absl::StatusCode::kDataLoss);
  std::string flipped = good;
  flipped[kManifestHeaderBytes + 3] ^= 1;
  absl::StatusOr<v1::DurableManifest> parsed = ParseManifestFile(flipped, "m");
  ASSERT_STATUS(parsed, absl::StatusCode::kDataLoss);
  EXPECT_NE(parsed.status().message().find("CRC-32C"), std::string::npos) << parsed.status();
}

// Each mutation makes a manifest that parses but must not pass its checks.
TEST(ManifestTest, InconsistentRecordsAreRefused) {
  const std::vector<std::pair<std::string, std::function<void(v1::DurableManifest&)>>> mutations = {
      {"another node", [](v1::DurableManifest& m) { m.set_node_id(4); }},
      {"another step", [](v1::DurableManifest& m) { m.set_step(41); }},
      {"two files of one rank", [](v1::DurableManifest& m) { *m.add_files() = m.files(0); }},
      {"a rank without a file",
       [](v1::DurableManifest& m) { m.mutable_regions(1)->mutable_region()->set_rank(7); }},
      {"an unaligned offset", [](v1::DurableManifest& m) { m.mutable_regions(1)->set_offset(8193); }},
      {"past the end of its file",
       [](v1::DurableManifest& m) { m.mutable_files(0)->set_bytes(8192 + 4999); }},
      {"an offset that overflows",
       [](v1::DurableManifest& m) {
         m.mutable_regions(1)->set_offset(std::numeric_limits<uint64_t>::max() - 4095);
       }},
      {"bytes that overflow",
       [](v1::DurableManifest& m) {
         m.mutable_regions(1)->mutable_region()->set_bytes(std::numeric_limits<uint64_t>::max());
       }},
      {"too few CRCs",
       [](v1::DurableManifest& m) { m.mutable_regions(0)->mutable_region()->mutable_chunk_crcs()->RemoveLast(); }},
      {"too many CRCs",
       [](v1::DurableManifest& m) { m.mutable_regions(0)->mutable_region()->add_chunk_crcs(1); }},
      {"chunks of 0 bytes",
       [](v1::DurableManifest& m) { m.mutable_regions(0)->mutable_region()->set_chunk_bytes(0); }},
      {"chunks of 2 GiB",
       [](v1::DurableManifest& m) {
         m.mutable_regions(0)->mutable_region()->set_chunk_bytes(uint64_t{2} << 30);
       }},
      {"an empty name", [](v1::DurableManifest& m) { m.mutable_regions(0)->mutable_region()->set_region(""); }},
      {"a name of 5000 bytes",
       [](v1::DurableManifest& m) {
         m.mutable_regions(0)->mutable_region()->set_region(std::string(5000, 'a'));
       }},
      {"a region twice",
       [](v1::DurableManifest& m) {
         m.mutable_regions(1)->mutable_region()->set_region("layer0.weight");
       }},
      {"overlapping regions", [](v1::DurableManifest& m) { m.mutable_regions(1)->set_offset(4096); }},
      {"a negative dimension",
       [](v1::DurableManifest& m) { m.mutable_regions(0)->mutable_region()->set_shape(0, -1); }},
      {"more dimensions than a registration has",
       [](v1::DurableManifest& m) {
         for (int i = 0; i < kMaxShapeDimensions; ++i) {
           m.mutable_regions(0)->mutable_region()->add_shape(1);
         }
       }},
      {"a rank recorded twice", [](v1::DurableManifest& m) { *m.add_ranks() = m.ranks(0); }},
      {"a piece past its region",
       [](v1::DurableManifest& m) {
         v1::RegionPiece& piece = *m.mutable_regions(1)->mutable_region()->mutable_piece();
         piece.set_replica_group("data-parallel");
         piece.set_offset(4096);
         piece.set_region_bytes(5000);
       }},
  };
  for (const auto& [what, mutate] : mutations) {
    v1::DurableManifest manifest = TwoRegions();
    mutate(manifest);
    absl::StatusOr<v1::DurableManifest> parsed =
        ParseManifestFile(SerializeManifestFile(manifest), "m");
    ASSERT_OK(parsed) << what;
    EXPECT_STATUS(CheckManifest(*parsed, 3, 42), absl::StatusCode::kDataLoss) << what;
  }
}

// Random damage to the payload, with the header's CRC made to match so the parser and the checks
// see it: never a crash, and what passes the checks is still bounded by its files.
TEST(ManifestTest, DamagedPayloadsNeverCrashTheChecks) {
  const std::string good = SerializeManifestFile(TwoRegions());
  moesnap::testing::DeterministicBytes random(7);
  int accepted = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::string damaged = good;
    uint8_t noise[8];
    random.Fill(noise, sizeof(noise));
    for (int i = 0; i < 1 + noise[0] % 4; ++i) {
      const size_t at = kManifestHeaderBytes + (noise[1 + i] * 131 + trial) % (good.size() - kManifestHeaderBytes);
      damaged[at] = static_cast<char>(noise[5 + i % 3]);
    }
    const uint32_t crc = erasure::Crc32c(damaged.data() + kManifestHeaderBytes,
                                         damaged.size() - kManifestHeaderBytes);
    for (int i = 0; i < 4; ++i) damaged[12 + i] = static_cast<char>((crc >> (8 * i)) & 0xff);
    absl::StatusOr<v1::DurableManifest> parsed = ParseManifestFile(damaged, "m");
    if (!parsed.ok() || !CheckManifest(*parsed, 3, 42).ok()) continue;
    ++accepted;
    for (const v1::DurableRegion& record : parsed->regions()) {
      ASSERT_LE(record.offset() + record.region().bytes(), parsed->files(0).bytes());
    }
  }
  EXPECT_LT(accepted, 2000);  // most damage is caught
}

}  // namespace
}  // namespace moesnap::daemon::durable
