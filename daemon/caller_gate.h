// Calls in flight per caller of a gRPC service whose calls may park their thread while they wait
// (the Peer service's Prepare and Encode, a trainer's WaitCommitted). The service's threads are
// capped (a call beyond the cap is refused by gRPC); without a bound per caller, one caller sending
// many waiting calls at once would hold every thread and starve the others. A call beyond its
// caller's bound is answered RESOURCE_EXHAUSTED at once.
#ifndef MOESNAP_DAEMON_CALLER_GATE_H_
#define MOESNAP_DAEMON_CALLER_GATE_H_

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace moesnap::metrics {
class Counter;
}  // namespace moesnap::metrics

namespace moesnap::daemon {

// Thread-safe.
class CallerGate {
 public:
  // Holds one of a caller's slots until it is destroyed. Move-only.
  class Pass {
   public:
    Pass(Pass&& other) noexcept : gate_(other.gate_), caller_(std::move(other.caller_)) {
      other.gate_ = nullptr;
    }
    Pass& operator=(Pass&&) = delete;
    Pass(const Pass&) = delete;
    ~Pass();

   private:
    friend class CallerGate;
    Pass(CallerGate* gate, std::string caller) : gate_(gate), caller_(std::move(caller)) {}
    CallerGate* gate_;
    std::string caller_;
  };

  // Each refusal adds one to `refused` (the owner's metric), which must outlive the gate.
  CallerGate(int per_caller, metrics::Counter* refused)
      : per_caller_(per_caller), refused_(refused) {}

  // A slot of `caller` (a node, a rank), or RESOURCE_EXHAUSTED naming the caller and the bound
  // when all of its slots are held.
  absl::StatusOr<Pass> Enter(const std::string& caller);
  int in_flight(const std::string& caller) const;

 private:
  void Leave(const std::string& caller);

  const int per_caller_;
  metrics::Counter* const refused_;
  mutable absl::Mutex mutex_;
  absl::flat_hash_map<std::string, int> in_flight_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_CALLER_GATE_H_
