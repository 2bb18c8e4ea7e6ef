// Copies to and from memory a trainer shares with the daemon, surviving the trainer shrinking the
// file under the copy. A page past a shared file's new end raises SIGBUS when touched, which would
// kill the daemon with every rank's state; a guarded copy catches that SIGBUS on its own thread
// (sigsetjmp before, siglongjmp from the handler) and reports failure instead.
#ifndef MOESNAP_DAEMON_BUS_ERROR_GUARD_H_
#define MOESNAP_DAEMON_BUS_ERROR_GUARD_H_

#include <cstddef>
#include <cstdint>

namespace moesnap::daemon {

// Installs the process's SIGBUS handler (once; thread-safe). A SIGBUS outside a guarded copy
// keeps its default action: the process dies with a core dump, as without the handler.
void InstallBusErrorGuard();

// erasure::CopyWithCrc32c (copy and CRC-32C in one pass, `*crc` extended by the bytes stored)
// that returns false instead of dying when touching either side raises SIGBUS (then the
// destination holds an unknown part of the bytes and `*crc` is unchanged). Needs
// InstallBusErrorGuard first.
bool GuardedCopyWithCrc32c(void* destination, const void* source, size_t bytes, uint32_t* crc);

// An atomic (sequentially consistent) load of `*source` into `*value`; false instead of dying when
// touching it raises SIGBUS. Needs InstallBusErrorGuard first.
bool GuardedLoad(const uint64_t* source, uint64_t* value);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_BUS_ERROR_GUARD_H_
