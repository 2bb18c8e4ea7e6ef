// How a device backend cuts a batch of transfers for its copy engine, without touching a device:
// slices of the transfers in order, in groups of a fixed size, each group's slices that are
// contiguous on both sides copied as one, and each transfer's CRC-32C extended slice by slice as
// the slices land. The CUDA backend queues a group's copies and checksums the group once it has
// landed, while the next groups move.
#ifndef MOESNAP_DAEMON_TRANSFER_GROUPS_H_
#define MOESNAP_DAEMON_TRANSFER_GROUPS_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "daemon/copy_backend.h"

namespace moesnap::daemon {

class TransferGroups {
 public:
  struct Slice {
    size_t transfer;
    uint64_t at;  // into the transfer
    uint64_t bytes;
  };

  // Slices of `transfers` in order, each within one transfer, in groups of `group_bytes` (the
  // last group holds the rest).
  TransferGroups(std::span<const Transfer> transfers, uint64_t group_bytes);

  size_t groups() const { return group_ends_.size(); }
  std::span<const Slice> group(size_t index) const;

  // Extends the CRC-32C of each slice's transfer over the slice's bytes in host memory, in order:
  // a transfer's CRC starts at its first slice from its `crc`, or from the CRC of the transfer
  // before it where it continues that one.
  static void ExtendCrcs(std::span<Transfer> transfers, std::span<const Slice> slices);

  // Calls copy(device, host, bytes) once per run of `slices` contiguous both on the device
  // (device_bytes(transfer, at): where byte `at` of a transfer is) and in host memory, within one
  // allocation (allocation_of(transfer)): two allocations may lie side by side in the copier's
  // address space, but no copy may span them. The first failure ends the calls.
  template <typename DeviceBytes, typename AllocationOf, typename Copy>
  static absl::Status CopyContiguous(std::span<const Transfer> transfers,
                                     std::span<const Slice> slices, DeviceBytes device_bytes,
                                     AllocationOf allocation_of, Copy copy);

 private:
  std::vector<Slice> slices_;
  std::vector<size_t> group_ends_;  // into slices_
};

template <typename DeviceBytes, typename AllocationOf, typename Copy>
absl::Status TransferGroups::CopyContiguous(std::span<const Transfer> transfers,
                                            std::span<const Slice> slices,
                                            DeviceBytes device_bytes, AllocationOf allocation_of,
                                            Copy copy) {
  for (size_t i = 0; i < slices.size();) {
    const Slice& first = slices[i];
    const Transfer& head = transfers[first.transfer];
    uint8_t* device = device_bytes(head, first.at);
    uint8_t* host = head.host + first.at;
    const void* allocation = allocation_of(head);
    uint64_t bytes = first.bytes;
    for (++i; i < slices.size(); ++i) {
      const Slice& next = slices[i];
      const Transfer& transfer = transfers[next.transfer];
      if (allocation_of(transfer) != allocation ||
          device_bytes(transfer, next.at) != device + bytes ||
          transfer.host + next.at != host + bytes) {
        break;
      }
      bytes += next.bytes;
    }
    if (absl::Status status = copy(device, host, bytes); !status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_TRANSFER_GROUPS_H_
