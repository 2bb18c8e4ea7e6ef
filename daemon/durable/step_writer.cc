// WriteStep: data files chunk by chunk at the rate limit, then the manifest, then publication.
#include "daemon/durable/step_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/durable/manifest.h"
#include "daemon/durable/pacer.h"

namespace moesnap::daemon::durable {
namespace {

// Written bytes are handed to the kernel's writeback this often, so that the final sync does not
// find gigabytes of dirty pages and the page cache is not filled with a drain's data.
constexpr uint64_t kWritebackBytes = uint64_t{64} << 20;

class File {
 public:
  static absl::StatusOr<File> Create(const std::string& path) {
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return ErrnoStatus(errno, absl::StrCat("creating ", path));
    return File(fd, path);
  }
  File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) { other.fd_ = -1; }
  ~File() {
    if (fd_ >= 0) close(fd_);
  }

  absl::Status WriteAt(const uint8_t* data, uint64_t length, uint64_t offset) {
    while (length > 0) {
      const ssize_t written = pwrite(fd_, data, std::min<uint64_t>(length, 1 << 30),
                                     static_cast<off_t>(offset));
      if (written < 0 && errno == EINTR) continue;
      if (written <= 0) {
        return ErrnoStatus(written < 0 ? errno : ENOSPC,
                           absl::StrCat("writing ", length, " bytes at offset ", offset, " of ",
                                        path_));
      }
      data += written;
      length -= static_cast<uint64_t>(written);
      offset += static_cast<uint64_t>(written);
    }
    return absl::OkStatus();
  }

  // Starts writeback of [from, to) and lets go of the pages already written back.
  void StartWriteback(uint64_t from, uint64_t to) {
    sync_file_range(fd_, static_cast<off_t>(from), static_cast<off_t>(to - from),
                    SYNC_FILE_RANGE_WRITE);
  }

  // Makes the file durable and drops its pages from the page cache.
  absl::Status SyncAndClose() {
    if (fdatasync(fd_) != 0) return ErrnoStatus(errno, absl::StrCat("syncing ", path_));
    posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
    const int fd = fd_;
    fd_ = -1;
    if (close(fd) != 0) return ErrnoStatus(errno, absl::StrCat("closing ", path_));
    return absl::OkStatus();
  }

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_;
  std::string path_;
};

uint64_t AlignUp(uint64_t offset) {
  return (offset + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
}

absl::StatusOr<uint64_t> WriteFiles(const std::string& partial, const NodeImage& image, v1::DurableManifest& manifest,
                                    const WriteOptions& options, Clock* clock,
                                    std::atomic<uint64_t>* written, const std::atomic<bool>& stop) {
  // Regions by rank, in image order.
  std::map<uint32_t, std::vector<int>> by_rank;
  for (int i = 0; i < image.manifest().regions_size(); ++i) {
    by_rank[image.manifest().regions(i).rank()].push_back(i);
  }
  Pacer pacer(options.bytes_per_second, clock);
  pacer.Start();
  uint64_t total = 0;
  for (const auto& [rank, regions] : by_rank) {
    const std::string path = absl::StrCat(partial, "/", DataFileName(rank));
    absl::StatusOr<File> file = File::Create(path);
    if (!file.ok()) return file.status();
    uint64_t end = 0;
    uint64_t written_back = 0;
    for (int index : regions) {
      const v1::ImageRegion& region = image.manifest().regions(index);
      const PoolBytes& bytes = *image.stored()[index];
      const uint64_t start = AlignUp(end);
      v1::DurableRegion* record = manifest.add_regions();
      *record->mutable_region() = region;
      record->set_offset(start);
      for (int chunk = 0; chunk < region.chunk_crcs_size(); ++chunk) {
        if (stop.load()) return absl::CancelledError("the daemon is stopping");
        const uint64_t offset = uint64_t(chunk) * region.chunk_bytes();
        const uint64_t length = std::min(region.chunk_bytes(), region.bytes() - offset);
        const uint32_t crc = bytes.Crc32c(offset, length);
        if (crc != region.chunk_crcs(chunk)) {
          return absl::DataLossError(absl::StrFormat(
              "region '%s' of rank %d, step %d, chunk %d: the pool holds CRC-32C %08x, the capture "
              "recorded %08x; a corrupt snapshot is not made durable (moesnapctl verify lists "
              "the damage)", region.region(), rank, region.step(), chunk, crc,
              region.chunk_crcs(chunk)));
        }
        absl::Status status;
        bytes.ForEach(offset, length, [&](const uint8_t* piece, uint64_t piece_bytes, uint64_t at) {
          if (status.ok()) status = file->WriteAt(piece, piece_bytes, start + offset + at);
        });
        if (!status.ok()) return status;
        if (written != nullptr) written->fetch_add(length);
        if (start + offset + length - written_back >= kWritebackBytes) {
          file->StartWriteback(written_back, start + offset + length);
          written_back = start + offset + length;
        }
        pacer.Account(length, stop);
      }
      end = start + region.bytes();
    }
    if (absl::Status status = file->SyncAndClose(); !status.ok()) return status;
    v1::DurableFile* record = manifest.add_files();
    record->set_rank(rank);
    record->set_bytes(end);
    total += end;
  }
  return total;
}

}  // namespace

absl::StatusOr<WrittenStep> WriteStep(const DurableDirectory& directory, int64_t step,
                                      const NodeImage& image, const StepIdentity& identity,
                                      const WriteOptions& options, Clock* clock,
                                      std::atomic<uint64_t>* written,
                                      const std::atomic<bool>& stop) {
  const absl::Time started = clock->Now();
  absl::StatusOr<std::string> partial = directory.CreatePartial(step);
  if (!partial.ok()) return partial.status();
  v1::DurableManifest manifest;
  manifest.set_node_id(identity.node_id);
  manifest.set_step(step);
  manifest.set_created_unix_ms(absl::ToUnixMillis(started));
  manifest.set_cluster_digest(identity.cluster_digest);
  if (identity.shape.data_units() > 0) *manifest.mutable_shape() = identity.shape;
  manifest.set_cluster_nodes(identity.cluster_nodes);
  *manifest.mutable_ranks() = image.manifest().ranks();

  absl::StatusOr<uint64_t> data =
      WriteFiles(*partial, image, manifest, options, clock, written, stop);
  absl::Status status = data.status();
  const std::string contents = SerializeManifestFile(manifest);
  if (status.ok()) {
    absl::StatusOr<File> file = File::Create(absl::StrCat(*partial, "/", kManifestFileName));
    status = file.status();
    if (status.ok()) status = file->WriteAt(reinterpret_cast<const uint8_t*>(contents.data()),
                                            contents.size(), 0);
    if (status.ok()) status = file->SyncAndClose();
  }
  if (status.ok()) status = directory.Publish(step);
  if (!status.ok()) {
    directory.Discard(step);
    return status;
  }
  return WrittenStep{step, *data + contents.size(), clock->Now() - started};
}

}  // namespace moesnap::daemon::durable
