// Is the daemon alive, and is it ready? One answer for every asker: /healthz and /readyz, the gRPC
// health service on both sockets, and systemd (READY=1, and WATCHDOG=1 only after a probe of the
// running daemon succeeded, never from a blind timer: a daemon whose store is wedged stops pinging
// and systemd restarts it).
#ifndef MOESNAP_DAEMON_HEALTH_H_
#define MOESNAP_DAEMON_HEALTH_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace moesnap::daemon {

// Tells the service manager about the daemon's state ("READY=1", "WATCHDOG=1", "STOPPING=1").
class ServiceNotifier {
 public:
  virtual ~ServiceNotifier() = default;
  virtual void Notify(const std::string& state) = 0;
  // How often systemd wants WATCHDOG=1 (half its WatchdogSec), or nullopt when it wants none.
  virtual std::optional<absl::Duration> WatchdogInterval() = 0;
};

// sd_notify(3) to $NOTIFY_SOCKET; does nothing when the daemon was not started by systemd.
std::unique_ptr<ServiceNotifier> CreateSystemdNotifier();

// Asks the running daemon through its admin socket for its status (the accept loop, the gRPC
// server's threads and the store's lock all have to answer), within `deadline`.
absl::Status ProbeAdminSocket(const std::string& admin_socket, absl::Duration deadline);

class HealthMonitor {
 public:
  struct Options {
    // Probes the running daemon; OK means alive. Called from the monitor's own thread.
    std::function<absl::Status()> probe;
    // OK once the daemon can serve what it holds (a replacement: once it has rebuilt).
    std::function<absl::Status()> ready;
    // Told when readiness changes (the gRPC health service's status).
    std::function<void(bool serving)> on_serving_changed;
    // Probe interval without a systemd watchdog (with one: the watchdog's).
    absl::Duration interval = absl::Seconds(5);
  };

  // Starts probing at once; `notifier` must outlive the monitor.
  HealthMonitor(Options options, ServiceNotifier* notifier);
  ~HealthMonitor();  // stops the probe thread

  // OK when a probe succeeded within the last three intervals; otherwise why not.
  absl::Status Alive() const;
  // OK when alive and ready.
  absl::Status Ready() const;
  // Waits up to `timeout` for the first successful probe; then the same as Alive().
  absl::Status WaitAlive(absl::Duration timeout) const;
  // Tells the service manager READY=1 (with a STATUS= line); watchdog pings follow only after it.
  void AnnounceReady(const std::string& status);

 private:
  void Loop();
  bool ProbedAlive() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    return last_alive_ != absl::InfinitePast();
  }

  Options options_;
  ServiceNotifier* notifier_;
  absl::Duration interval_;
  mutable absl::Mutex mutex_;
  absl::Time last_alive_ ABSL_GUARDED_BY(mutex_) = absl::InfinitePast();
  absl::Status last_probe_ ABSL_GUARDED_BY(mutex_) = absl::UnavailableError("not probed yet");
  bool serving_ ABSL_GUARDED_BY(mutex_) = false;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  bool announced_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread thread_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_HEALTH_H_
