// StepReader: manifest checks, file sizes, CRC-checked chunk reads.
#include "daemon/durable/step_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/durable/manifest.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon::durable {
namespace {

absl::StatusOr<std::string> ReadBoundedFile(const std::string& path, uint64_t limit) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  struct stat info {};
  std::string bytes;
  absl::Status status;
  if (fstat(fd, &info) != 0) {
    status = ErrnoStatus(errno, absl::StrCat("reading the size of ", path));
  } else if (!S_ISREG(info.st_mode) || static_cast<uint64_t>(info.st_size) > limit) {
    status = absl::DataLossError(absl::StrCat(path, " is not a regular file of at most ", limit,
                                              " bytes"));
  } else {
    bytes.resize(static_cast<size_t>(info.st_size));
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t got = pread(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        status = got < 0 ? ErrnoStatus(errno, absl::StrCat("reading ", path))
                         : absl::DataLossError(absl::StrCat(path, " shrank while it was read"));
        break;
      }
      done += static_cast<size_t>(got);
    }
  }
  close(fd);
  if (!status.ok()) return status;
  return bytes;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StepReader>> StepReader::Open(const DurableDirectory& directory,
                                                             int64_t step) {
  const std::string path = directory.StepPath(step);
  const std::string manifest_path = absl::StrCat(path, "/", kManifestFileName);
  absl::StatusOr<std::string> bytes =
      ReadBoundedFile(manifest_path, kManifestHeaderBytes + kMaxManifestPayloadBytes);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<v1::DurableManifest> manifest = ParseManifestFile(*bytes, manifest_path);
  if (!manifest.ok()) return manifest.status();
  if (absl::Status status = CheckManifest(*manifest, directory.node_id(), step); !status.ok()) {
    return status;
  }
  std::unique_ptr<StepReader> reader(new StepReader(path, *std::move(manifest)));
  for (const v1::DurableFile& file : reader->manifest_.files()) {
    const std::string data_path = absl::StrCat(path, "/", DataFileName(file.rank()));
    const int fd = open(data_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", data_path));
    reader->files_[file.rank()] = fd;  // closed by the destructor from here on
    struct stat info {};
    if (fstat(fd, &info) != 0) return ErrnoStatus(errno, absl::StrCat("reading the size of ", data_path));
    if (!S_ISREG(info.st_mode) || static_cast<uint64_t>(info.st_size) != file.bytes()) {
      return absl::DataLossError(absl::StrCat(data_path, " holds ", info.st_size,
                                              " bytes, the manifest says ", file.bytes()));
    }
  }
  return reader;
}

StepReader::~StepReader() {
  for (const auto& [rank, fd] : files_) close(fd);
}

absl::StatusOr<int> StepReader::Find(uint32_t rank, const std::string& name) const {
  for (int i = 0; i < manifest_.regions_size(); ++i) {
    const v1::ImageRegion& region = manifest_.regions(i).region();
    if (region.rank() == rank && region.region() == name) return i;
  }
  return absl::NotFoundError(absl::StrCat("durable step ", manifest_.step(), " of node ",
                                          manifest_.node_id(), " holds no region '", name,
                                          "' of rank ", rank));
}

absl::Status StepReader::ReadChunk(int region, uint32_t chunk, uint8_t* out) const {
  if (region < 0 || region >= manifest_.regions_size()) {
    return absl::OutOfRangeError(absl::StrCat("no region ", region, " in durable step ",
                                              manifest_.step()));
  }
  const v1::ImageRegion& record = manifest_.regions(region).region();
  if (chunk >= static_cast<uint32_t>(record.chunk_crcs_size())) {
    return absl::OutOfRangeError(absl::StrCat("region '", record.region(), "' has ",
                                              record.chunk_crcs_size(), " chunks, not ", chunk + 1));
  }
  const uint64_t offset = uint64_t{chunk} * record.chunk_bytes();
  const uint64_t length = std::min(record.chunk_bytes(), record.bytes() - offset);
  // Within the file: CheckManifest bounded offset + bytes by the file size Open checked.
  const uint64_t at = manifest_.regions(region).offset() + offset;
  const int fd = files_.at(record.rank());
  uint64_t done = 0;
  while (done < length) {
    const ssize_t got = pread(fd, out + done, length - done, static_cast<off_t>(at + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return got < 0 ? ErrnoStatus(errno, absl::StrCat("reading ", path_, "/", DataFileName(record.rank())))
                     : absl::DataLossError(absl::StrCat(path_, "/", DataFileName(record.rank()),
                                                        " ends before the manifest says"));
    }
    done += static_cast<uint64_t>(got);
  }
  if (const uint32_t crc = erasure::Crc32c(out, length); crc != record.chunk_crcs(chunk)) {
    return absl::DataLossError(absl::StrFormat(
        "durable step %d of node %d, region '%s' of rank %d, chunk %d: the disk holds CRC-32C %08x, "
        "the manifest says %08x", manifest_.step(), manifest_.node_id(), record.region(),
        record.rank(), chunk, crc, record.chunk_crcs(chunk)));
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon::durable
