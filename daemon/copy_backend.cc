// The batch copies every backend has unless it has its own: one transfer after another.
#include "daemon/copy_backend.h"

namespace moesnap::daemon {
namespace {

template <typename Copy>
absl::Status EachTransfer(std::span<Transfer> transfers, Copy copy) {
  for (size_t i = 0; i < transfers.size(); ++i) {
    absl::StatusOr<uint32_t> crc = copy(transfers[i], CrcBefore(transfers, i));
    if (!crc.ok()) return crc.status();
    transfers[i].crc = *crc;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CopyBackend::CopyOutBatch(std::span<Transfer> transfers) {
  return EachTransfer(transfers, [this](Transfer& transfer, uint32_t crc) {
    return CopyOut(*transfer.source, transfer.offset, transfer.host, transfer.bytes, crc);
  });
}

absl::Status CopyBackend::CopyInBatch(std::span<Transfer> transfers) {
  return EachTransfer(transfers, [this](Transfer& transfer, uint32_t crc) {
    return CopyIn(*transfer.source, transfer.offset, transfer.host, transfer.bytes, crc);
  });
}

}  // namespace moesnap::daemon
