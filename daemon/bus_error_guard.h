// Copies to and from memory a trainer shares with the daemon, surviving the trainer shrinking the
// file under the copy. A page past a shared file's new end raises SIGBUS when touched, which would
// kill the daemon with every rank's state; a guarded copy catches that SIGBUS on its own thread
// (sigsetjmp before, siglongjmp from the handler) and reports failure instead.
#ifndef MOESNAP_DAEMON_BUS_ERROR_GUARD_H_
#define MOESNAP_DAEMON_BUS_ERROR_GUARD_H_

#include <cstddef>

namespace moesnap::daemon {

// Installs the process's SIGBUS handler (once; thread-safe). A SIGBUS outside a guarded copy
// keeps its default action: the process dies with a core dump, as without the handler.
void InstallBusErrorGuard();

// memcpy that returns false instead of dying when touching either side raises SIGBUS (then the
// destination holds an unknown prefix of the bytes). Needs InstallBusErrorGuard first.
bool GuardedCopy(void* destination, const void* source, size_t bytes);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_BUS_ERROR_GUARD_H_
