/* Moves PyTorch CPU storages, in place, into one shared-memory file mapped once: the moesnap
 * package (torch_helpers.py, through ctypes) hands the file to moesnapd by one descriptor and
 * registers each tensor as a range of it, instead of a file, a mapping and a descriptor per
 * storage. Every tensor viewing a moved storage keeps viewing it (views, flat buffers, tied
 * weights), because the storage object stays the same; only its data pointer changes.
 *
 * Compiled against c10's headers of one torch release: a storage is a c10::StorageImpl, whose
 * layout is that release's. The package calls nothing but the version functions unless
 * moesnap_torch_storage_version() is the running torch's release and the C++ ABI flags agree, and
 * each call checks every storage's data pointer and size against what Python sees before changing
 * any. Links nothing of torch: c10's inline code only.
 *
 * Ownership: a mapping is reference-counted; its creator holds one reference, and each storage
 * moved into it another, dropped when the storage frees its memory (whatever thread does that).
 * The file and its mapping go with the last reference. Functions are thread-safe; moving a
 * storage another thread is using is not. */
#ifndef MOESNAP_CLIENT_PYTHON_NATIVE_TORCH_STORAGE_H_
#define MOESNAP_CLIENT_PYTHON_NATIVE_TORCH_STORAGE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOESNAP_TORCH_STORAGE_API __attribute__((visibility("default")))

typedef struct moesnap_storage_mapping moesnap_storage_mapping;

/* The torch release whose headers this library was compiled with, e.g. "1.13.0". */
MOESNAP_TORCH_STORAGE_API const char* moesnap_torch_storage_version(void);
/* _GLIBCXX_USE_CXX11_ABI of the compilation (torch.compiled_with_cxx11_abi() must agree). */
MOESNAP_TORCH_STORAGE_API int moesnap_torch_storage_cxx11_abi(void);

/* Maps all `bytes` of the shared-memory file `fd` read-write with its page tables filled, and
 * takes ownership of `fd` (closed with the mapping; also on failure). Returns 0, or the errno of
 * the failure. */
MOESNAP_TORCH_STORAGE_API int moesnap_storage_mapping_open(int fd, uint64_t bytes,
                                                           moesnap_storage_mapping** mapping);
MOESNAP_TORCH_STORAGE_API uintptr_t moesnap_storage_mapping_address(
    const moesnap_storage_mapping* mapping);
/* Drops the caller's reference. */
MOESNAP_TORCH_STORAGE_API void moesnap_storage_mapping_release(moesnap_storage_mapping* mapping);

/* Moves `count` CPU storages (c10::StorageImpl addresses) into `mapping`, storage i at
 * `offsets[i]`, copying its `bytes[i]` bytes there when `copy` is nonzero (else the range keeps
 * what the file holds). `bytes[i]` is the storage's size as the caller read it just before (its
 * nbytes() is not read here: in this torch it would need a c10 symbol). Nothing is changed unless,
 * for every storage, `data[i]` is its data pointer, its device is the CPU and `bytes[i]` from
 * `offsets[i]` lies inside the mapping: returns the index of the first storage failing that, or
 * -1 when all moved. The storages' previous memory is freed by their previous owners. */
MOESNAP_TORCH_STORAGE_API int64_t moesnap_storage_move(void* const* storages,
                                                       const uintptr_t* data,
                                                       const uint64_t* bytes,
                                                       const uint64_t* offsets, size_t count,
                                                       moesnap_storage_mapping* mapping, int copy);

#ifdef __cplusplus
}
#endif

#endif  /* MOESNAP_CLIENT_PYTHON_NATIVE_TORCH_STORAGE_H_ */
