// The SIGBUS handler jumps back into the guarded copy of the faulting thread. SA_NODEFER keeps
// SIGBUS unblocked after the jump, so sigsetjmp need not save the signal mask (a system call per
// copy).
#include "daemon/bus_error_guard.h"

#include <atomic>
#include <csetjmp>
#include <csignal>
#include <mutex>

#include "absl/functional/function_ref.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon {
namespace {

// Where the current thread's guarded copy resumes; null outside one. Initial-exec TLS: reading it
// in a signal handler never allocates.
thread_local sigjmp_buf* guarded_copy_resume __attribute__((tls_model("initial-exec"))) = nullptr;

void OnBusError(int, siginfo_t*, void*) {
  if (sigjmp_buf* resume = guarded_copy_resume; resume != nullptr) {
    guarded_copy_resume = nullptr;
    siglongjmp(*resume, 1);
  }
  // Not a guarded copy: the default action, when the faulting instruction runs again.
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigaction(SIGBUS, &fallback, nullptr);
}

// Runs `touch`; false, once the handler jumped back here, when it raised SIGBUS. Not inlined: its
// frame is the one the handler jumps back into.
__attribute__((noinline)) bool Guarded(absl::FunctionRef<void()> touch) {
  sigjmp_buf resume;
  if (sigsetjmp(resume, 0) != 0) return false;  // the handler cleared guarded_copy_resume
  guarded_copy_resume = &resume;
  std::atomic_signal_fence(std::memory_order_seq_cst);  // armed before the first byte is touched
  touch();
  std::atomic_signal_fence(std::memory_order_seq_cst);
  guarded_copy_resume = nullptr;
  return true;
}

}  // namespace

void InstallBusErrorGuard() {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction action {};
    action.sa_sigaction = OnBusError;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, nullptr);
  });
}

bool GuardedCopyWithCrc32c(void* destination, const void* source, size_t bytes, uint32_t* crc) {
  uint32_t extended = 0;
  if (!Guarded([&] { extended = erasure::CopyWithCrc32c(destination, source, bytes, *crc); })) {
    return false;
  }
  *crc = extended;
  return true;
}

bool GuardedLoad(const uint64_t* source, uint64_t* value) {
  return Guarded([&] { *value = __atomic_load_n(source, __ATOMIC_SEQ_CST); });
}

}  // namespace moesnap::daemon
