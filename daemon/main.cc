// moesnapd: parse flags, load the config, start the daemon, serve until SIGTERM or SIGINT. Built a
// second time as moesnapd-faults (MOESNAP_FAULT_INJECTION) for the crash tests, which alone reads
// the MOESNAP_CRASH_* and MOESNAP_REBUILD_HOLD_STEPS variables: a production daemon cannot be told
// to kill itself or to hold a rebuild.
#include <sys/resource.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <string>

#include <CLI/CLI.hpp>

#include "absl/strings/numbers.h"
#include "common/log.h"
#include "common/version.h"
#include "daemon/config.h"
#include "daemon/daemon.h"

#ifdef MOESNAP_FAULT_INJECTION
// The crashes the environment asks for.
moesnap::daemon::FaultInjection FaultsFromEnvironment() {
  moesnap::daemon::FaultInjection faults;
  int64_t value = 0;
  if (const char* text = std::getenv("MOESNAP_CRASH_IN_JOURNAL_WRITE");
      text != nullptr && absl::SimpleAtoi(text, &value)) {
    faults.crash_in_journal_write = value;
  }
  if (const char* text = std::getenv("MOESNAP_CRASH_IN_COMMIT");
      text != nullptr && absl::SimpleAtoi(text, &value)) {
    faults.crash_in_commit = value;
  }
  if (const char* text = std::getenv("MOESNAP_REBUILD_HOLD_STEPS");
      text != nullptr && absl::SimpleAtoi(text, &value)) {
    faults.rebuild_hold_steps = value;
  }
  return faults;
}
#endif

// The daemon holds descriptors per trainer (its connections, the files kept for its restart) and
// per peer: the soft limit (1024 by default) is raised to the hard one the system allows.
void RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    moesnap::Log(moesnap::LogLevel::kWarning, "cannot raise the open-file limit to ",
                 limit.rlim_max, ": ", std::strerror(errno));
  }
}

int main(int argc, char** argv) {
  CLI::App app{"moesnapd: keeps the training state of this node's ranks in memory"};
  std::string config_path = "/etc/moesnap/moesnapd.toml";
  app.add_option("-c,--config", config_path, "TOML configuration (see deploy/moesnapd.toml)");
  std::optional<uint32_t> node_id;
  app.add_option("--node-id", node_id,
                 "This node's id, replacing [node] id and $MOESNAP_NODE_ID (for a Slurm prolog or a "
                 "Kubernetes pod)");
  std::string advertise_host;
  CLI::Option* advertise_host_given = app.add_option(
      "--advertise-host", advertise_host,
      "The address peers reach this node on, replacing cluster.advertise_host and "
      "$MOESNAP_ADVERTISE_HOST");
  bool check_only = false;
  app.add_flag("--check-config", check_only,
               "Check the configuration, list every error, and exit (0: valid) without starting");
  app.set_version_flag("--version", moesnap::VersionLine("moesnapd"));
  CLI11_PARSE(app, argc, argv);

  // Block the stop signals before any thread starts, so only sigwait below receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  absl::StatusOr<moesnap::daemon::DaemonOptions> options =
      moesnap::daemon::LoadDaemonOptions(config_path);
  // The node's id and address: the command line, else the environment, else the file.
  absl::StatusOr<moesnap::daemon::NodeIdentity> identity =
      moesnap::daemon::NodeIdentityFromEnvironment();
  if (identity.ok()) {
    if (node_id) identity->node_id = node_id;
    if (*advertise_host_given) identity->advertise_host = advertise_host;
  }
  absl::Status valid = !options.ok() ? options.status() : identity.status();
  if (valid.ok()) valid = moesnap::daemon::ApplyNodeIdentity(*identity, &*options);
  if (!valid.ok()) {
    std::fprintf(stderr, "moesnapd: %s\n", valid.ToString().c_str());
    return 2;
  }
  if (check_only) {
    std::printf("%s: valid\n", config_path.c_str());
    return 0;
  }
#ifdef MOESNAP_FAULT_INJECTION
  options->faults = FaultsFromEnvironment();
#endif
  moesnap::daemon::StopLockOrderTracking();
  moesnap::ConfigureLog(options->log_level, options->log_format, options->node_id);
  RaiseOpenFileLimit();
  absl::StatusOr<std::unique_ptr<moesnap::daemon::Daemon>> daemon =
      moesnap::daemon::Daemon::Start(*options);
  if (!daemon.ok()) {
    std::fprintf(stderr, "moesnapd: %s\n", daemon.status().ToString().c_str());
    return 1;
  }
  int received = 0;
  sigwait(&stop_signals, &received);
  moesnap::Log(moesnap::LogLevel::kInfo, "stopping on signal ", received);
  daemon->reset();
  return 0;
}
