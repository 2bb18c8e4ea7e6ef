// The transfers of a copy task: every pool extent of each chunk it copies, in order, handed to the
// chunks' backends as one batch per run of chunks of one backend (a run of small regions on the GPU
// waits on the device once, not once per region).
#ifndef MOESNAP_DAEMON_TASK_TRANSFERS_H_
#define MOESNAP_DAEMON_TASK_TRANSFERS_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "daemon/copy_backend.h"
#include "daemon/pool.h"

namespace moesnap::daemon {

class TaskTransfers {
 public:
  // Makes room for `chunks` chunks of one pool extent each (a task's whole list, allocated once).
  void Reserve(size_t chunks) {
    transfers_.reserve(chunks);
    chunks_.reserve(chunks);
  }

  // Chunk `length` bytes at `offset` of `stored`, at `source_offset` of `source`: a transfer per
  // pool extent, each after the first continuing the one before it. `expected` (a restore's stored
  // CRC-32C of the chunk) goes with a chunk of one transfer (Transfer::expected).
  void AddChunk(CopyBackend* backend, RegionSource* source, uint64_t source_offset,
                const PoolBytes& stored, uint64_t offset, uint64_t length,
                std::optional<uint32_t> expected = std::nullopt) {
    const size_t begin = transfers_.size();
    stored.ForEach(offset, length, [&](uint8_t* data, uint64_t bytes, uint64_t at) {
      transfers_.push_back({source, source_offset + at, data, bytes, transfers_.size() > begin});
    });
    if (transfers_.size() == begin + 1) transfers_.back().expected = expected;
    chunks_.push_back({backend, transfers_.size()});
  }

  // Runs copy(backend, transfers) on each maximal run of chunks of one backend, then
  // finished(chunk, crc) for each chunk of a run that succeeded, in order (the CRC-32C of the
  // chunk's bytes). Stops at the first failure, which it returns with the first and last chunk of
  // its run in `failed`.
  template <typename Copy, typename Finished>
  absl::Status Run(Copy copy, Finished finished, std::pair<size_t, size_t>& failed) {
    size_t begin = 0;  // of the run's transfers
    for (size_t first = 0; first < chunks_.size();) {
      size_t last = first;
      while (last + 1 < chunks_.size() && chunks_[last + 1].backend == chunks_[first].backend) {
        ++last;
      }
      const size_t end = chunks_[last].end;
      std::span<Transfer> batch = std::span<Transfer>(transfers_).subspan(begin, end - begin);
      if (absl::Status status = copy(*chunks_[first].backend, batch); !status.ok()) {
        failed = {first, last};
        return status;
      }
      for (size_t chunk = first; chunk <= last; ++chunk) {
        const size_t chunk_begin = chunk == 0 ? 0 : chunks_[chunk - 1].end;
        finished(chunk, chunks_[chunk].end > chunk_begin ? transfers_[chunks_[chunk].end - 1].crc
                                                         : 0u);
      }
      first = last + 1;
      begin = end;
    }
    return absl::OkStatus();
  }

 private:
  struct Chunk {
    CopyBackend* backend;
    size_t end;  // of its transfers
  };
  std::vector<Transfer> transfers_;
  std::vector<Chunk> chunks_;
};

// `failure` of a TaskTransfers::Run, naming what its failed run [failed.first, failed.second]
// held: one chunk of a region, or the run of regions it copied. `at(i)` is chunk i's region name
// and chunk index; `what` the operation ("copy", "restore").
template <typename RegionAndChunk>
absl::Status NameFailedRun(const absl::Status& failure, std::pair<size_t, size_t> failed,
                           RegionAndChunk at, absl::string_view what) {
  const auto [region, chunk] = at(failed.first);
  return absl::Status(
      failure.code(),
      failed.first == failed.second
          ? absl::StrCat(what, " of region '", region, "' chunk ", chunk, " failed: ",
                         failure.message())
          : absl::StrCat(what, " of the ", failed.second - failed.first + 1, " regions from '",
                         region, "' to '", at(failed.second).first, "' failed: ",
                         failure.message()));
}

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_TASK_TRANSFERS_H_
