// Manifest files: a little-endian header then the protobuf payload; every record checked.
#include "daemon/durable/manifest.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/region_limits.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon::durable {
namespace {

constexpr char kMagic[8] = {'M', 'O', 'E', 'S', 'N', 'A', 'P', 'M'};

void PutLittleEndian(uint64_t value, int bytes, char* out) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

uint64_t GetLittleEndian(const char* in, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t{static_cast<uint8_t>(in[i])} << (8 * i);
  return value;
}

}  // namespace

std::string DataFileName(uint32_t rank) { return absl::StrCat("rank-", rank, ".data"); }

// Header: magic (8) | format version u32 | payload CRC-32C u32 | payload length u64 | zero u64.
std::string SerializeManifestFile(const v1::DurableManifest& manifest) {
  const std::string payload = manifest.SerializeAsString();
  std::string file(kManifestHeaderBytes, '\0');
  std::memcpy(file.data(), kMagic, sizeof(kMagic));
  PutLittleEndian(kManifestFormatVersion, 4, file.data() + 8);
  PutLittleEndian(erasure::Crc32c(payload.data(), payload.size()), 4, file.data() + 12);
  PutLittleEndian(payload.size(), 8, file.data() + 16);
  return file + payload;
}

absl::StatusOr<v1::DurableManifest> ParseManifestFile(absl::string_view bytes,
                                                      const std::string& origin) {
  if (bytes.size() < kManifestHeaderBytes) {
    return absl::DataLossError(absl::StrCat(origin, ": ", bytes.size(), " bytes, shorter than the ",
                                            kManifestHeaderBytes, "-byte manifest header"));
  }
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(origin, ": not a moesnap manifest (bad magic)"));
  }
  const uint64_t version = GetLittleEndian(bytes.data() + 8, 4);
  if (version != kManifestFormatVersion) {
    return absl::DataLossError(absl::StrCat(origin, ": manifest format ", version,
                                            ", this daemon reads format ", kManifestFormatVersion));
  }
  const uint32_t crc = static_cast<uint32_t>(GetLittleEndian(bytes.data() + 12, 4));
  const uint64_t length = GetLittleEndian(bytes.data() + 16, 8);
  if (length > kMaxManifestPayloadBytes || length != bytes.size() - kManifestHeaderBytes) {
    return absl::DataLossError(absl::StrCat(origin, ": header says ", length,
                                            " payload bytes, the file holds ",
                                            bytes.size() - kManifestHeaderBytes, " (at most ",
                                            kMaxManifestPayloadBytes, " accepted)"));
  }
  const absl::string_view payload = bytes.substr(kManifestHeaderBytes);
  if (const uint32_t actual = erasure::Crc32c(payload.data(), payload.size()); actual != crc) {
    return absl::DataLossError(absl::StrFormat("%s: payload CRC-32C is %08x, the header says %08x",
                                               origin, actual, crc));
  }
  v1::DurableManifest manifest;
  if (!manifest.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return absl::DataLossError(absl::StrCat(origin, ": the payload is not a DurableManifest"));
  }
  return manifest;
}

absl::Status CheckManifest(const v1::DurableManifest& manifest, uint32_t node_id, int64_t step) {
  const auto error = [&](const std::string& what) {
    return absl::DataLossError(
        absl::StrCat("manifest of step ", step, " of node ", node_id, ": ", what));
  };
  if (manifest.node_id() != node_id || manifest.step() != step) {
    return error(absl::StrCat("it describes step ", manifest.step(), " of node ",
                              manifest.node_id()));
  }
  std::map<uint32_t, uint64_t> file_bytes;
  for (const v1::DurableFile& file : manifest.files()) {
    if (!file_bytes.emplace(file.rank(), file.bytes()).second) {
      return error(absl::StrCat("rank ", file.rank(), " has two data files"));
    }
  }
  std::set<std::pair<uint32_t, std::string>> names;
  std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> ranges;  // per rank file
  for (const v1::DurableRegion& record : manifest.regions()) {
    const v1::ImageRegion& region = record.region();
    const std::string where = absl::StrCat("region '", region.region().substr(0, 256), "' of rank ",
                                           region.rank());
    if (absl::Status status = CheckStoredRegion(region); !status.ok()) {
      return error(absl::StrCat(where, ": ", status.message()));
    }
    if (!names.emplace(region.rank(), region.region()).second) {
      return error(absl::StrCat(where, " appears twice"));
    }
    // A reader holds a chunk at a time in memory.
    if (region.chunk_bytes() < kMinChunkBytes || region.chunk_bytes() > kMaxChunkBytes) {
      return error(absl::StrCat(where, ": chunks of ", region.chunk_bytes(), " bytes (",
                                kMinChunkBytes, " to ", kMaxChunkBytes, " accepted)"));
    }
    auto file = file_bytes.find(region.rank());
    if (file == file_bytes.end()) return error(absl::StrCat(where, ": its rank has no data file"));
    if (record.offset() % kRegionAlignment != 0 || record.offset() > file->second ||
        region.bytes() > file->second - record.offset()) {
      return error(absl::StrCat(where, ": ", region.bytes(), " bytes at offset ", record.offset(),
                                " do not lie aligned within ", DataFileName(region.rank()), " of ",
                                file->second, " bytes"));
    }
    ranges[region.rank()].emplace_back(record.offset(), record.offset() + region.bytes());
  }
  for (auto& [rank, spans] : ranges) {
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i) {
      if (spans[i].first < spans[i - 1].second) {
        return error(absl::StrCat("two regions of rank ", rank, " overlap at offset ",
                                  spans[i].first, " of ", DataFileName(rank)));
      }
    }
  }
  std::set<uint32_t> ranks;
  for (const v1::JournalRank& rank : manifest.ranks()) {
    if (!ranks.insert(rank.rank()).second) {
      return error(absl::StrCat("rank ", rank.rank(), " has two records"));
    }
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon::durable
