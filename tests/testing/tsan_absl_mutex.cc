// ThreadSanitizer builds only (deploy/sanitize.sh): tells TSan about the locking done by Debian's
// abseil. absl::Mutex, absl::CondVar and absl::Notification are compiled into
// libabsl_synchronization without TSan, so their atomics and futex waits order nothing in TSan's
// eyes, and every field a Mutex guards, or a Notification hands over, would be reported as a race. This file defines the public entry points of Mutex and CondVar in the test
// program, which the dynamic linker binds ahead of the library's (for our code, and for the calls
// that abseil's Notification and gRPC make into the library), and each wraps the library's own
// function in the annotations abseil itself makes in a TSan build of it: a mutex's lock and unlock
// become TSan lock events, and what the library runs inside them (the conditions it evaluates on
// behalf of other threads) is ignored, as abseil's annotated build ignores it. A wrapped function
// must not reach another through the library (it would be annotated twice): the library's
// ...WithTimeout calls are its ...WithDeadline ones, so here they call our ...WithDeadline.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/base/options.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

#define MOESNAP_TSAN_STRINGIFY2(x) #x
#define MOESNAP_TSAN_STRINGIFY(x) MOESNAP_TSAN_STRINGIFY2(x)

// The mangled name of absl::<rest>, with abseil's inline namespace (Debian's: "debian3") in it;
// `rest` of a const member function starts with "K".
std::string AbslSymbol(const char* rest) {
  const bool const_member = rest[0] == 'K';
  if (const_member) ++rest;
  std::string name = const_member ? "_ZNK4absl" : "_ZN4absl";
#if ABSL_OPTION_USE_INLINE_NAMESPACE
  const std::string inline_namespace = MOESNAP_TSAN_STRINGIFY(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  name += std::to_string(inline_namespace.size()) + inline_namespace;
#endif
  return name + rest;
}

// The library's definition of the function we define here: the next one in lookup order.
template <typename Function>
Function Next(const char* rest) {
  const std::string name = AbslSymbol(rest);
  void* const symbol = dlsym(RTLD_NEXT, name.c_str());
  if (symbol == nullptr) {
    std::fprintf(stderr, "tsan_absl_mutex: %s not found in abseil: %s\n", name.c_str(), dlerror());
    std::abort();
  }
  return reinterpret_cast<Function>(symbol);
}

using LockFn = void (*)(absl::Mutex*);
using TryLockFn = bool (*)(absl::Mutex*);
using WhenFn = void (*)(absl::Mutex*, const absl::Condition&);
using WhenDeadlineFn = bool (*)(absl::Mutex*, const absl::Condition&, absl::Time);
using WaitFn = void (*)(absl::CondVar*, absl::Mutex*);
using WaitDeadlineFn = bool (*)(absl::CondVar*, absl::Mutex*, absl::Time);

constexpr unsigned kRead = __tsan_mutex_read_lock;

// Lock and unlock as TSan sees them around the library's call `locking` or `unlocking`.
template <typename Call>
auto Locked(absl::Mutex* mu, unsigned flags, Call locking) {
  __tsan_mutex_pre_lock(mu, flags);
  auto result = locking();
  __tsan_mutex_post_lock(mu, flags, 0);
  return result;
}
template <typename Call>
void Unlocked(absl::Mutex* mu, unsigned flags, Call unlocking) {
  __tsan_mutex_pre_unlock(mu, flags);
  unlocking();
  __tsan_mutex_post_unlock(mu, flags);
}
// A try-lock as TSan sees it: taken, or tried and failed.
template <typename Call>
bool TriedLock(absl::Mutex* mu, unsigned flags, Call trying) {
  flags |= __tsan_mutex_try_lock;
  __tsan_mutex_pre_lock(mu, flags);
  const bool locked = trying();
  __tsan_mutex_post_lock(mu, flags | (locked ? 0 : __tsan_mutex_try_lock_failed), 0);
  return locked;
}
// A wait that releases `mu` inside the library and holds it again when it returns.
template <typename Call>
auto Released(absl::Mutex* mu, unsigned flags, Call waiting) {
  __tsan_mutex_pre_unlock(mu, flags);
  auto result = waiting();
  __tsan_mutex_post_unlock(mu, flags);
  __tsan_mutex_pre_lock(mu, flags);
  __tsan_mutex_post_lock(mu, flags, 0);
  return result;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static const LockFn next = Next<LockFn>("5Mutex4LockEv");
  Locked(this, 0, [&] { next(this); return true; });
}

void Mutex::ReaderLock() {
  static const LockFn next = Next<LockFn>("5Mutex10ReaderLockEv");
  Locked(this, kRead, [&] { next(this); return true; });
}

bool Mutex::TryLock() {
  static const TryLockFn next = Next<TryLockFn>("5Mutex7TryLockEv");
  return TriedLock(this, 0, [&] { return next(this); });
}

bool Mutex::ReaderTryLock() {
  static const TryLockFn next = Next<TryLockFn>("5Mutex13ReaderTryLockEv");
  return TriedLock(this, kRead, [&] { return next(this); });
}

void Mutex::Unlock() {
  static const LockFn next = Next<LockFn>("5Mutex6UnlockEv");
  Unlocked(this, 0, [&] { next(this); });
}

void Mutex::ReaderUnlock() {
  static const LockFn next = Next<LockFn>("5Mutex12ReaderUnlockEv");
  Unlocked(this, kRead, [&] { next(this); });
}

void Mutex::LockWhen(const Condition& cond) {
  static const WhenFn next = Next<WhenFn>("5Mutex8LockWhenERKNS0_9ConditionE");
  Locked(this, 0, [&] { next(this, cond); return true; });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static const WhenFn next =
      Next<WhenFn>("5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  Locked(this, kRead, [&] { next(this, cond); return true; });
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  return LockWhenWithDeadline(cond, Now() + timeout);
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  return ReaderLockWhenWithDeadline(cond, Now() + timeout);
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const WhenDeadlineFn next =
      Next<WhenDeadlineFn>("5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Locked(this, 0, [&] { return next(this, cond, deadline); });
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const WhenDeadlineFn next =
      Next<WhenDeadlineFn>("5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Locked(this, kRead, [&] { return next(this, cond, deadline); });
}

// Await is called with the mutex held exclusively: neither our code nor gRPC holds an abseil mutex
// shared (a shared holder would show as a TSan report on the unlock here).
void Mutex::Await(const Condition& cond) {
  static const WhenFn next = Next<WhenFn>("5Mutex5AwaitERKNS0_9ConditionE");
  Released(this, 0, [&] { next(this, cond); return true; });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  return AwaitWithDeadline(cond, Now() + timeout);
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static const WhenDeadlineFn next =
      Next<WhenDeadlineFn>("5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Released(this, 0, [&] { return next(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  static const WaitFn next = Next<WaitFn>("7CondVar4WaitEPNS0_5MutexE");
  Released(mu, 0, [&] { next(this, mu); return true; });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  return WaitWithDeadline(mu, Now() + timeout);
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static const WaitDeadlineFn next =
      Next<WaitDeadlineFn>("7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return Released(mu, 0, [&] { return next(this, mu, deadline); });
}

// A Notification hands over what its notifier wrote before Notify to whoever returns from a wait
// on it. The library's wait returns at once, taking no lock, when the notification came first, so
// its Mutex alone (seen through the functions above) would not order the two: the notifier
// releases the object itself and a wait that saw the notification acquires it.
using NotifyFn = void (*)(Notification*);
using AwaitNotificationFn = void (*)(const Notification*);
using AwaitNotificationTimeoutFn = bool (*)(const Notification*, Duration);
using AwaitNotificationDeadlineFn = bool (*)(const Notification*, Time);

void Notification::Notify() {
  static const NotifyFn next = Next<NotifyFn>("12Notification6NotifyEv");
  __tsan_release(this);
  next(this);
}

void Notification::WaitForNotification() const {
  static const AwaitNotificationFn next =
      Next<AwaitNotificationFn>("K12Notification19WaitForNotificationEv");
  next(this);
  __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  static const AwaitNotificationTimeoutFn next = Next<AwaitNotificationTimeoutFn>(
      "K12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool notified = next(this, timeout);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  static const AwaitNotificationDeadlineFn next = Next<AwaitNotificationDeadlineFn>(
      "K12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const bool notified = next(this, deadline);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl
