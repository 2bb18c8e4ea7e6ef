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
  std::optional<uint32_t> node_id;
  app.add_option("--node-id", node_id,
                 "This node's id, replacing [node] id (for a Slurm prolog or a Kubernetes pod)");
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
      moesnap::daemon::LoadDaemonOptions(config_path, node_id);
  if (!options.ok()) {
    std::fprintf(stderr, "moesnapd: %s\n", options.status().ToString().c_str());
    return 2;
  }
  if (check_only) {
    std::printf("%s: valid\n", config_path.c_str());
    return 0;
  }
  moesnap::ConfigureLog(options->log_level, options->log_format, options->node_id);
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
