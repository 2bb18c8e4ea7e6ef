// HealthMonitor's probe loop, the systemd notifier over libsystemd, and the admin-socket probe.
#include "daemon/health.h"

#include <systemd/sd-daemon.h>

#include <cstring>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "proto/moesnap.grpc.pb.h"

namespace moesnap::daemon {
namespace {

class SystemdNotifier final : public ServiceNotifier {
 public:
  void Notify(const std::string& state) override {
    if (const int result = sd_notify(0, state.c_str()); result < 0) {
      Log(LogLevel::kWarning, "sd_notify(", state, ") failed: ", std::strerror(-result));
    }
  }

  std::optional<absl::Duration> WatchdogInterval() override {
    uint64_t microseconds = 0;
    if (sd_watchdog_enabled(0, &microseconds) <= 0 || microseconds == 0) return std::nullopt;
    return absl::Microseconds(microseconds) / 2;
  }
};

}  // namespace

std::unique_ptr<ServiceNotifier> CreateSystemdNotifier() { return std::make_unique<SystemdNotifier>(); }

absl::Status ProbeAdminSocket(const std::string& admin_socket, absl::Duration deadline) {
  auto stub = v1::Admin::NewStub(
      grpc::CreateChannel("unix:" + admin_socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  v1::StatusResponse response;
  const grpc::Status status = stub->Status(&context, v1::StatusRequest(), &response);
  if (status.ok()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("the admin socket ", admin_socket,
                                             " did not answer a status call within ",
                                             absl::FormatDuration(deadline), ": ",
                                             status.error_message()));
}

HealthMonitor::HealthMonitor(Options options, ServiceNotifier* notifier)
    : options_(std::move(options)), notifier_(notifier) {
  const std::optional<absl::Duration> watchdog = notifier_->WatchdogInterval();
  interval_ = watchdog ? *watchdog : options_.interval;
  if (watchdog) Log(LogLevel::kInfo, "systemd watchdog: a probe every ", absl::FormatDuration(*watchdog));
  thread_ = std::thread([this] { Loop(); });
}

HealthMonitor::~HealthMonitor() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  thread_.join();
}

void HealthMonitor::Loop() {
  const bool watchdog = notifier_->WatchdogInterval().has_value();
  while (true) {
    const absl::Status alive = options_.probe();
    const bool serving = alive.ok() && options_.ready().ok();
    bool changed = false;
    bool announced = false;
    {
      absl::MutexLock lock(&mutex_);
      last_probe_ = alive;
      if (alive.ok()) last_alive_ = absl::Now();
      changed = serving != serving_;
      serving_ = serving;
      announced = announced_;
    }
    if (alive.ok() && watchdog && announced) notifier_->Notify("WATCHDOG=1");
    if (!alive.ok()) Log(LogLevel::kWarning, "health probe failed: ", alive.message());
    if (changed && options_.on_serving_changed) options_.on_serving_changed(serving);
    absl::MutexLock lock(&mutex_);
    if (mutex_.AwaitWithTimeout(absl::Condition(&stopping_), interval_)) return;
  }
}

absl::Status HealthMonitor::Alive() const {
  absl::MutexLock lock(&mutex_);
  if (absl::Now() - last_alive_ <= 3 * interval_) return absl::OkStatus();
  if (!last_probe_.ok()) return last_probe_;
  return absl::UnavailableError(absl::StrCat("no probe has succeeded for ",
                                             absl::FormatDuration(absl::Now() - last_alive_)));
}

absl::Status HealthMonitor::WaitAlive(absl::Duration timeout) const {
  {
    absl::MutexLock lock(&mutex_);
    mutex_.AwaitWithTimeout(absl::Condition(this, &HealthMonitor::ProbedAlive), timeout);
  }
  return Alive();
}

void HealthMonitor::AnnounceReady(const std::string& status) {
  absl::MutexLock lock(&mutex_);  // held: no ping can slip in before READY=1
  notifier_->Notify("READY=1\nSTATUS=" + status);
  announced_ = true;
}

absl::Status HealthMonitor::Ready() const {
  if (absl::Status alive = Alive(); !alive.ok()) return alive;
  return options_.ready();
}

}  // namespace moesnap::daemon
