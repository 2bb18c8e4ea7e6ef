// PeerRequests: per-peer queues served in turn by a few threads.
#include "daemon/cluster/peer_requests.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace moesnap::daemon::cluster {

PeerRequests::PeerRequests(int threads, int threads_per_peer, int queued_per_peer)
    : threads_per_peer_(threads_per_peer), queued_per_peer_(queued_per_peer) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

PeerRequests::~PeerRequests() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    for (auto& [id, peer] : peers_) peer.queued.clear();
    ready_.SignalAll();
  }
  for (std::thread& thread : threads_) thread.join();
}

absl::Status PeerRequests::Add(uint32_t peer, Request request) {
  absl::MutexLock lock(&mutex_);
  if (stopping_) return absl::UnavailableError("this node is stopping");
  Peer& queue = peers_[peer];
  const int ahead = static_cast<int>(queue.queued.size()) + queue.running;
  if (ahead >= queued_per_peer_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "node ", peer, " has ", queued_per_peer_, " requests queued or running here already"));
  }
  queue.queued.push_back({std::move(request), ahead});
  ready_.Signal();
  return absl::OkStatus();
}

int PeerRequests::Forget(uint32_t peer) {
  absl::MutexLock lock(&mutex_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return 0;
  const int dropped = static_cast<int>(it->second.queued.size());
  it->second.queued.clear();
  if (it->second.running == 0) peers_.erase(it);
  return dropped;
}

std::map<uint32_t, PeerRequests::Peer>::iterator PeerRequests::NextReady(uint32_t after) {
  auto ready = [&](const Peer& peer) {
    return !peer.queued.empty() && peer.running < threads_per_peer_;
  };
  for (auto it = peers_.upper_bound(after); it != peers_.end(); ++it) {
    if (ready(it->second)) return it;
  }
  for (auto it = peers_.begin(); it != peers_.end() && it->first <= after; ++it) {
    if (ready(it->second)) return it;
  }
  return peers_.end();
}

void PeerRequests::Run() {
  absl::MutexLock lock(&mutex_);
  while (true) {
    auto next = NextReady(last_served_);
    if (next == peers_.end()) {
      if (stopping_) return;
      ready_.Wait(&mutex_);
      continue;
    }
    const uint32_t id = next->first;
    last_served_ = id;
    Queued queued = std::move(next->second.queued.front());
    next->second.queued.pop_front();
    ++next->second.running;
    mutex_.Unlock();
    std::move(queued.request)(queued.ahead);
    mutex_.Lock();
    // The entry stays while a request of it runs: only here is it erased.
    Peer& peer = peers_[id];
    --peer.running;
    if (peer.running == 0 && peer.queued.empty()) peers_.erase(id);
    // A thread of this peer's is free again: another thread may take its next request.
    ready_.Signal();
  }
}

}  // namespace moesnap::daemon::cluster
