// The SIGBUS handler jumps back into the guarded copy of the faulting thread. SA_NODEFER keeps
// SIGBUS unblocked after the jump, so sigsetjmp need not save the signal mask (a system call per
// copy).
#include "daemon/bus_error_guard.h"

#include <atomic>
#include <csetjmp>
#include <csignal>
#include <mutex>

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

__attribute__((noinline)) bool GuardedCopyWithCrc32c(void* destination, const void* source,
                                                     size_t bytes, uint32_t* crc) {
  sigjmp_buf resume;
  if (sigsetjmp(resume, 0) != 0) return false;  // the handler cleared guarded_copy_resume
  guarded_copy_resume = &resume;
  std::atomic_signal_fence(std::memory_order_seq_cst);  // armed before the first byte is touched
  const uint32_t extended = erasure::CopyWithCrc32c(destination, source, bytes, *crc);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  guarded_copy_resume = nullptr;
  *crc = extended;
  return true;
}

__attribute__((noinline)) bool GuardedLoad(const uint64_t* source, uint64_t* value) {
  sigjmp_buf resume;
  if (sigsetjmp(resume, 0) != 0) return false;  // the handler cleared guarded_copy_resume
  guarded_copy_resume = &resume;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  const uint64_t loaded = __atomic_load_n(source, __ATOMIC_SEQ_CST);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  guarded_copy_resume = nullptr;
  *value = loaded;
  return true;
}

}  // namespace moesnap::daemon
