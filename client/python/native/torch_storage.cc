// The storage mover of torch_storage.h: one reference-counted mapping of a memfd, and
// c10::StorageImpl::set_data_ptr_noswap with a deleter that drops a reference on it.
#include "client/python/native/torch_storage.h"

#include <c10/core/StorageImpl.h>
#include <sys/mman.h>
#include <torch/version.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

struct moesnap_storage_mapping {
  std::atomic<uint64_t> references{1};
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  int fd = -1;
};

namespace {

void Release(moesnap_storage_mapping* mapping) {
  if (mapping->references.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  munmap(mapping->data, mapping->bytes);
  close(mapping->fd);
  delete mapping;
}

// The DataPtr deleter of a moved storage: its memory is part of the mapping.
void ReleaseStorageMemory(void* context) {
  Release(static_cast<moesnap_storage_mapping*>(context));
}

}  // namespace

extern "C" {

const char* moesnap_torch_storage_version(void) { return TORCH_VERSION; }

int moesnap_torch_storage_cxx11_abi(void) { return _GLIBCXX_USE_CXX11_ABI; }

int moesnap_storage_mapping_open(int fd, uint64_t bytes, moesnap_storage_mapping** mapping) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (data == MAP_FAILED) {
    const int error = errno;
    close(fd);
    return error;
  }
  auto* opened = new moesnap_storage_mapping;
  opened->data = static_cast<uint8_t*>(data);
  opened->bytes = bytes;
  opened->fd = fd;
  *mapping = opened;
  return 0;
}

uintptr_t moesnap_storage_mapping_address(const moesnap_storage_mapping* mapping) {
  return reinterpret_cast<uintptr_t>(mapping->data);
}

void moesnap_storage_mapping_release(moesnap_storage_mapping* mapping) { Release(mapping); }

int64_t moesnap_storage_move(void* const* storages, const uintptr_t* data, const uint64_t* bytes,
                             const uint64_t* offsets, size_t count,
                             moesnap_storage_mapping* mapping, int copy) {
  for (size_t i = 0; i < count; ++i) {
    const auto* storage = static_cast<const c10::StorageImpl*>(storages[i]);
    if (reinterpret_cast<uintptr_t>(storage->data()) != data[i] ||
        storage->device_type() != c10::DeviceType::CPU || offsets[i] > mapping->bytes ||
        bytes[i] > mapping->bytes - offsets[i]) {
      return static_cast<int64_t>(i);
    }
  }
  for (size_t i = 0; i < count; ++i) {
    auto* storage = static_cast<c10::StorageImpl*>(storages[i]);
    uint8_t* target = mapping->data + offsets[i];
    if (copy != 0 && bytes[i] > 0) std::memcpy(target, storage->data(), bytes[i]);
    mapping->references.fetch_add(1, std::memory_order_relaxed);
    storage->set_data_ptr_noswap(
        c10::DataPtr(target, mapping, &ReleaseStorageMemory, storage->device()));
  }
  return -1;
}

}  // extern "C"
