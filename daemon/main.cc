// moesnapd: parse flags, load the config, start the daemon, serve until SIGTERM or SIGINT.
#include <csignal>
#include <cstdio>

#include <CLI/CLI.hpp>

#include "common/log.h"
#include "common/version.h"
#include "daemon/config.h"
#include "daemon/daemon.h"

int main(int argc, char** argv) {
  CLI::App app{"moesnapd: keeps the training state of this node's ranks in memory"};
  std::string config_path = "/etc/moesnap/moesnapd.toml";
  app.add_option("-c,--config", config_path, "TOML configuration (see deploy/moesnapd.toml)");
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
  if (!options.ok()) {
    std::fprintf(stderr, "moesnapd: %s\n", options.status().ToString().c_str());
    return 2;
  }
  moesnap::SetLogLevel(options->log_level);
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
