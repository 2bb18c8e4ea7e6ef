// moesnapd: parse flags, load the config, start the daemon, serve until SIGTERM or SIGINT.
#include <csignal>
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "common/log.h"
#include "common/version.h"
#include "daemon/config.h"
#include "daemon/daemon.h"

int main(int argc, char** argv) {
  CLI::App app{"moesnapd: keeps the training state of this node's ranks in memory"};
  std::string config_path = "/etc/moesnap/moesnapd.toml";
  app.add_option("-c,--config", config_path, "TOML configuration (see deploy/moesnapd.toml)");
  uint32_t node_id = 0;
  CLI::Option* node_id_given = app.add_option(
      "--node-id", node_id, "this node's id in the job (else $MOESNAP_NODE_ID, else [node] id)");
  std::string advertise_host;
  CLI::Option* advertise_host_given = app.add_option("--advertise-host", advertise_host,
                 "the address peers reach this node on (else $MOESNAP_ADVERTISE_HOST, else "
                 "cluster.advertise_host)");
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
  absl::StatusOr<moesnap::daemon::NodeIdentity> identity =
      moesnap::daemon::NodeIdentityFromEnvironment();
  if (identity.ok()) {
    if (*node_id_given) identity->node_id = node_id;
    if (*advertise_host_given) identity->advertise_host = advertise_host;
  }
  absl::Status valid = !options.ok() ? options.status() : identity.status();
  if (valid.ok()) valid = moesnap::daemon::ApplyNodeIdentity(*identity, &*options);
  if (!valid.ok()) {
    std::fprintf(stderr, "moesnapd: %s\n", valid.ToString().c_str());
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
