#include "daemon/transfer_groups.h"

#include <algorithm>

#include "erasure/crc32c.h"

namespace moesnap::daemon {

TransferGroups::TransferGroups(std::span<const Transfer> transfers, uint64_t group_bytes) {
  uint64_t filled = 0;
  for (size_t t = 0; t < transfers.size(); ++t) {
    for (uint64_t at = 0; at < transfers[t].bytes;) {
      const uint64_t bytes = std::min(group_bytes - filled, transfers[t].bytes - at);
      slices_.push_back({t, at, bytes});
      at += bytes;
      filled += bytes;
      if (filled == group_bytes) {
        group_ends_.push_back(slices_.size());
        filled = 0;
      }
    }
  }
  if (filled > 0) group_ends_.push_back(slices_.size());
}

std::span<const TransferGroups::Slice> TransferGroups::group(size_t index) const {
  const size_t begin = index == 0 ? 0 : group_ends_[index - 1];
  return std::span<const Slice>(slices_).subspan(begin, group_ends_[index] - begin);
}

void TransferGroups::ExtendCrcs(std::span<Transfer> transfers, std::span<const Slice> slices) {
  for (const Slice& slice : slices) {
    Transfer& transfer = transfers[slice.transfer];
    const uint32_t crc = slice.at == 0 ? CrcBefore(transfers, slice.transfer) : transfer.crc;
    transfer.crc = erasure::Crc32cExtend(crc, transfer.host + slice.at, slice.bytes);
  }
}

}  // namespace moesnap::daemon
