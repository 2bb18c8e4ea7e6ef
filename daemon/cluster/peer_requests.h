// Work that peers ask of this node over the data plane (a region sent back for an elastic
// restore), run by a few threads of its own so that the connection a request came on goes on
// reading: a request served on that connection's thread would stop it while the answer is written
// to the asking node, and two nodes serving each other so could each wait for the other to read.
#ifndef MOESNAP_DAEMON_CLUSTER_PEER_REQUESTS_H_
#define MOESNAP_DAEMON_CLUSTER_PEER_REQUESTS_H_

#include <cstdint>
#include <deque>
#include <map>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace moesnap::daemon::cluster {

// Thread-safe. Each peer's requests run in the order they came, at most `threads_per_peer` of them
// at once, so that a peer that stopped reading holds only those threads; the threads take peers
// in turn. The destructor drops queued requests and joins the threads once their running
// requests return.
class PeerRequests {
 public:
  PeerRequests(int threads, int threads_per_peer, int queued_per_peer);
  ~PeerRequests();
  PeerRequests(const PeerRequests&) = delete;
  PeerRequests& operator=(const PeerRequests&) = delete;

  // A request is called with how many of its peer's requests were queued or running when it
  // was added (so that it may refuse its work beyond a share).
  using Request = absl::AnyInvocable<void(int ahead)>;

  // Queues `request` of `peer`. RESOURCE_EXHAUSTED when `queued_per_peer` of its requests are
  // queued or running already.
  absl::Status Add(uint32_t peer, Request request);
  // Drops the requests of `peer` queued (not those running); how many.
  int Forget(uint32_t peer);

 private:
  struct Queued {
    Request request;
    int ahead = 0;
  };
  struct Peer {
    std::deque<Queued> queued;
    int running = 0;
  };
  void Run();
  // The next peer after `after` (in id order, wrapping) with a queued request and a thread to
  // spare; end() when none has.
  std::map<uint32_t, Peer>::iterator NextReady(uint32_t after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const int threads_per_peer_;
  const int queued_per_peer_;
  mutable absl::Mutex mutex_;
  absl::CondVar ready_;
  std::map<uint32_t, Peer> peers_ ABSL_GUARDED_BY(mutex_);
  uint32_t last_served_ ABSL_GUARDED_BY(mutex_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace moesnap::daemon::cluster

#endif  // MOESNAP_DAEMON_CLUSTER_PEER_REQUESTS_H_
