// Calls in flight per caller of the Peer service. The service's threads are capped (a call beyond
// the cap is refused by gRPC), and some calls park their thread while they wait (Prepare and Encode
// up to the commit timeout, Rebuild for a whole rebuild): without a bound per caller, one peer
// sending many such calls at once would hold every thread and starve the commit calls of the
// others. A call beyond its caller's bound is answered RESOURCE_EXHAUSTED at once.
#ifndef MOESNAP_DAEMON_CLUSTER_CALLER_GATE_H_
#define MOESNAP_DAEMON_CLUSTER_CALLER_GATE_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace moesnap::daemon::cluster {

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

  explicit CallerGate(int per_caller) : per_caller_(per_caller) {}

  // A slot of `caller` (a node, or a connection without TLS), or RESOURCE_EXHAUSTED naming the
  // caller and the bound when all of its slots are held.
  absl::StatusOr<Pass> Enter(const std::string& caller);
  int in_flight(const std::string& caller) const;
  // Calls refused by every gate of this process (moesnap_peer_calls_refused_total).
  static uint64_t refused_total();

 private:
  void Leave(const std::string& caller);

  const int per_caller_;
  mutable absl::Mutex mutex_;
  absl::flat_hash_map<std::string, int> in_flight_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_CALLER_GATE_H_
