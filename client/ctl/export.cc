// SafetensorsExport: regions sorted into files, bytes written where the layout puts them, CRC-32C
// checked per chunk, an index of everything.
#include "client/ctl/export.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/ctl/durable_format.h"
#include "client/ctl/json.h"
#include "client/ctl/safetensors.h"
#include "erasure/crc32c.h"

namespace moesnap::ctl {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// A region is a tensor when its dtype is a tensor type and its bytes hold exactly its elements.
// The Python client gives a tensor of no elements a region of one byte: still an (empty) tensor.
std::optional<SafetensorsTensor> AsTensor(const v1::ImageRegion& region) {
  std::optional<SafetensorsDtype> dtype = SafetensorsDtypeOf(region.dtype());
  if (!dtype) return std::nullopt;
  uint64_t elements = 1;
  for (int64_t dimension : region.shape()) {
    if (dimension < 0) return std::nullopt;
    if (dimension != 0 && elements > UINT64_MAX / static_cast<uint64_t>(dimension)) {
      return std::nullopt;
    }
    elements *= static_cast<uint64_t>(dimension);
  }
  if (elements > UINT64_MAX / dtype->element_bytes) return std::nullopt;
  const uint64_t bytes = elements * dtype->element_bytes;
  if (bytes != region.bytes() && !(bytes == 0 && region.bytes() == 1)) return std::nullopt;
  return SafetensorsTensor{region.region(), *dtype,
                           std::vector<int64_t>(region.shape().begin(), region.shape().end()),
                           bytes};
}

}  // namespace

struct SafetensorsExport::Destination {
  int file = -1;        // index into files_
  uint64_t offset = 0;  // of the region's first byte in that file
  uint64_t length = 0;  // bytes of the region written (0 for an empty tensor)
  uint64_t next = 0;    // region offset the next piece must start at
  uint32_t crc = 0;     // of the current chunk so far
};

struct SafetensorsExport::OutputFile {
  std::string name;
  std::string header;
  uint64_t bytes = 0;
  int fd = -1;
};

SafetensorsExport::SafetensorsExport(std::string directory, v1::ExportHeader header)
    : directory_(std::move(directory)), header_(std::move(header)) {}

SafetensorsExport::~SafetensorsExport() {
  for (OutputFile& file : files_) {
    if (file.fd >= 0) close(file.fd);
    if (!finished_) std::filesystem::remove(absl::StrCat(directory_, "/", file.name, ".partial"));
  }
}

absl::StatusOr<std::unique_ptr<SafetensorsExport>> SafetensorsExport::Begin(
    const std::string& directory, const v1::ExportHeader& header) {
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  if (error) return absl::UnavailableError(absl::StrCat("creating ", directory, ": ", error.message()));
  std::unique_ptr<SafetensorsExport> export_files(new SafetensorsExport(directory, header));
  if (absl::Status status = export_files->Plan(); !status.ok()) return status;
  return export_files;
}

absl::Status SafetensorsExport::Plan() {
  const std::map<std::string, std::string> common = {
      {"moesnap.step", absl::StrCat(header_.step())},
      {"moesnap.node", absl::StrCat(header_.node_id())},
      {"moesnap.tier", TierWord(header_.tier())}};
  // Per rank: its tensors, and the others as bytes.
  std::map<uint32_t, std::vector<SafetensorsTensor>> tensors;
  std::map<uint32_t, std::vector<SafetensorsTensor>> others;
  destinations_.resize(header_.regions_size());
  for (const v1::ImageRegion& region : header_.regions()) {
    if (region.region() == "__metadata__") {
      return absl::InvalidArgumentError("a region named '__metadata__' cannot be a safetensors name");
    }
    if (region.chunk_bytes() == 0 ||
        static_cast<uint64_t>(region.chunk_crcs_size()) !=
            (region.bytes() + region.chunk_bytes() - 1) / region.chunk_bytes()) {
      return absl::DataLossError(absl::StrCat("region '", region.region(), "' of rank ",
                                              region.rank(), ": ", region.chunk_crcs_size(),
                                              " chunk CRCs for ", region.bytes(), " bytes"));
    }
    if (std::optional<SafetensorsTensor> tensor = AsTensor(region)) {
      tensors[region.rank()].push_back(*std::move(tensor));
    } else {
      others[region.rank()].push_back(
          {region.region(), {"U8", 1}, {static_cast<int64_t>(region.bytes())}, region.bytes()});
    }
  }
  std::map<std::pair<uint32_t, std::string>, std::pair<int, uint64_t>> placed;  // -> file, offset
  auto add_file = [&](uint32_t rank, const std::string& name,
                      const std::vector<SafetensorsTensor>& contents, const std::string& format) {
    std::map<std::string, std::string> metadata = common;
    metadata["format"] = format;
    metadata["moesnap.rank"] = absl::StrCat(rank);
    SafetensorsLayout layout = LayOutSafetensors(contents, metadata);
    const int index = static_cast<int>(files_.size());
    for (const auto& [tensor, offset] : layout.offsets) placed[{rank, tensor}] = {index, offset};
    files_.push_back({name, std::move(layout.header), layout.file_bytes, -1});
  };
  for (const auto& [rank, contents] : tensors) {
    add_file(rank, absl::StrCat("rank-", rank, ".safetensors"), contents, "pt");
  }
  for (const auto& [rank, contents] : others) {
    add_file(rank, absl::StrCat("rank-", rank, ".other.safetensors"), contents, "moesnap-bytes");
  }
  for (int i = 0; i < header_.regions_size(); ++i) {
    const v1::ImageRegion& region = header_.regions(i);
    const auto& [file, offset] = placed.at({region.rank(), region.region()});
    const std::optional<SafetensorsTensor> tensor = AsTensor(region);
    destinations_[i] = {file, offset, tensor ? tensor->bytes : region.bytes(), 0, 0};
  }
  for (OutputFile& file : files_) {
    const std::string path = absl::StrCat(directory_, "/", file.name, ".partial");
    file.fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (file.fd < 0) return Errno(absl::StrCat("creating ", path));
    if (pwrite(file.fd, file.header.data(), file.header.size(), 0) !=
            static_cast<ssize_t>(file.header.size()) ||
        ftruncate(file.fd, static_cast<off_t>(file.bytes)) != 0) {
      return Errno(absl::StrCat("writing ", path));
    }
  }
  return absl::OkStatus();
}

absl::Status SafetensorsExport::Add(const v1::ExportData& data) {
  if (data.region() >= destinations_.size()) {
    return absl::DataLossError(absl::StrCat("bytes for region ", data.region(), " of ",
                                            destinations_.size()));
  }
  const v1::ImageRegion& region = header_.regions(static_cast<int>(data.region()));
  Destination& destination = destinations_[data.region()];
  const uint64_t length = data.data().size();
  const uint64_t chunk_end =
      std::min(region.bytes(), (data.offset() / region.chunk_bytes() + 1) * region.chunk_bytes());
  if (data.offset() != destination.next || length > chunk_end - data.offset()) {
    return absl::DataLossError(absl::StrCat("region '", region.region(), "': ", length,
                                            " bytes at offset ", data.offset(), ", expected them at ",
                                            destination.next, " within one chunk"));
  }
  if (data.offset() < destination.length) {  // an empty tensor's padding byte is not written
    const uint64_t written = std::min(length, destination.length - data.offset());
    const OutputFile& file = files_[destination.file];
    if (pwrite(file.fd, data.data().data(), written,
               static_cast<off_t>(destination.offset + data.offset())) !=
        static_cast<ssize_t>(written)) {
      return Errno(absl::StrCat("writing ", directory_, "/", file.name));
    }
  }
  destination.crc = erasure::Crc32cExtend(destination.crc, data.data().data(), length);
  destination.next += length;
  received_ += length;
  if (destination.next == chunk_end) {
    const uint64_t chunk = data.offset() / region.chunk_bytes();
    if (destination.crc != region.chunk_crcs(static_cast<int>(chunk))) {
      return absl::DataLossError(absl::StrFormat(
          "region '%s' of rank %d, chunk %d: received CRC-32C %08x, the daemon recorded %08x",
          region.region(), region.rank(), chunk, destination.crc,
          region.chunk_crcs(static_cast<int>(chunk))));
    }
    destination.crc = 0;
  }
  return absl::OkStatus();
}

absl::Status SafetensorsExport::Finish() {
  for (int i = 0; i < header_.regions_size(); ++i) {
    if (destinations_[i].next != header_.regions(i).bytes()) {
      return absl::DataLossError(absl::StrCat("region '", header_.regions(i).region(), "' of rank ",
                                              header_.regions(i).rank(), ": ", destinations_[i].next,
                                              " of its ", header_.regions(i).bytes(),
                                              " bytes arrived"));
    }
  }
  for (OutputFile& file : files_) {
    const std::string path = absl::StrCat(directory_, "/", file.name);
    if (fsync(file.fd) != 0) return Errno(absl::StrCat("syncing ", path));
    close(file.fd);
    file.fd = -1;
    if (rename((path + ".partial").c_str(), path.c_str()) != 0) {
      return Errno(absl::StrCat("renaming ", path, ".partial"));
    }
  }
  // index.json: every region, where it is, and what it is.
  std::map<uint32_t, std::vector<std::string>> regions;
  for (int i = 0; i < header_.regions_size(); ++i) {
    const v1::ImageRegion& region = header_.regions(i);
    const bool tensor = AsTensor(region).has_value();
    regions[region.rank()].push_back(absl::StrCat(
        JsonString(region.region()), ":{\"file\":", JsonString(files_[destinations_[i].file].name),
        ",\"kind\":", tensor ? "\"tensor\"" : "\"bytes\"", ",\"dtype\":", JsonString(region.dtype()),
        ",\"shape\":[", absl::StrJoin(region.shape(), ","), "],\"bytes\":", region.bytes(),
        ",\"step\":", region.step(), "}"));
  }
  std::map<uint32_t, int64_t> rank_steps;
  for (const v1::JournalRank& rank : header_.ranks()) rank_steps[rank.rank()] = rank.latest_committed_step();
  std::vector<std::string> ranks;
  for (const auto& [rank, entries] : regions) {
    ranks.push_back(absl::StrCat(
        "\"", rank, "\":{\"step\":", rank_steps.contains(rank) ? rank_steps[rank] : header_.step(),
        ",\"regions\":{", absl::StrJoin(entries, ","), "}}"));
  }
  const std::string index = absl::StrCat(
      "{\"format\":\"moesnap-export\",\"version\":1,\"step\":", header_.step(),
      ",\"node\":", header_.node_id(), ",\"tier\":", JsonString(TierWord(header_.tier())),
      ",\"ranks\":{", absl::StrJoin(ranks, ","), "}}\n");
  const std::string path = absl::StrCat(directory_, "/", kExportIndexName);
  const int fd = open((path + ".partial").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno(absl::StrCat("creating ", path));
  const bool written = write(fd, index.data(), index.size()) == static_cast<ssize_t>(index.size()) &&
                       fsync(fd) == 0;
  close(fd);
  if (!written || rename((path + ".partial").c_str(), path.c_str()) != 0) {
    return Errno(absl::StrCat("writing ", path));
  }
  finished_ = true;
  return absl::OkStatus();
}

std::vector<std::string> SafetensorsExport::files() const {
  std::vector<std::string> names;
  for (const OutputFile& file : files_) names.push_back(file.name);
  names.push_back(kExportIndexName);
  return names;
}

}  // namespace moesnap::ctl
