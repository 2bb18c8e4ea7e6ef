#include "tests/testing/etcd_process.h"

#include <signal.h>
#include <stdlib.h>  // mkdtemp
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/loopback_port.h"

namespace moesnap::testing {
namespace {

// How often the waits below look again at the members.
constexpr absl::Duration kPollInterval = absl::Milliseconds(20);

absl::Status RunCommand(const std::vector<std::string>& argv) {
  ChildProcess process(argv, {}, ChildProcess::Stderr::kCapture);
  std::string output;
  while (std::optional<std::string> line = process.ReadLine(std::chrono::seconds(30))) {
    absl::StrAppend(&output, *line, "\n");
  }
  const std::optional<int> code = process.Wait(std::chrono::seconds(30));
  if (code == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("'", absl::StrJoin(argv, " "), "' exited with ",
                                          code.has_value() ? std::to_string(*code) : "no exit",
                                          ": ", output));
}

// /proc/<pid>/stat's state letter ('T' once stopped), or '?' if unreadable.
char ProcessState(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string contents((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close_paren = contents.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= contents.size()) return '?';
  return contents[close_paren + 2];
}

}  // namespace

absl::StatusOr<TestCertificates> MakeTestCertificates(const std::string& directory) {
  const std::string openssl = MOESNAP_OPENSSL_BINARY;
  const TestCertificates files{.ca_file = directory + "/ca.pem",
                               .server_cert_file = directory + "/server.pem",
                               .server_key_file = directory + "/server.key",
                               .client_cert_file = directory + "/client.pem",
                               .client_key_file = directory + "/client.key"};
  const std::string ca_key = directory + "/ca.key";
  std::ofstream(directory + "/server.ext") << "subjectAltName=IP:127.0.0.1\n"
                                              "extendedKeyUsage=serverAuth\n";
  std::ofstream(directory + "/client.ext") << "extendedKeyUsage=clientAuth\n";
  const std::vector<std::string> ec = {"-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                                       "-nodes"};
  auto with = [](std::vector<std::string> head, const std::vector<std::string>& tail) {
    head.insert(head.end(), tail.begin(), tail.end());
    return head;
  };
  std::vector<std::vector<std::string>> commands = {
      with({openssl, "req", "-x509"}, with(ec, {"-keyout", ca_key, "-out", files.ca_file, "-subj",
                                                "/CN=moesnap-test-ca", "-days", "2"})),
  };
  int serial = 1;
  for (const auto& [name, cert, key] :
       {std::tuple{std::string("server"), files.server_cert_file, files.server_key_file},
        std::tuple{std::string("client"), files.client_cert_file, files.client_key_file}}) {
    const std::string request = absl::StrCat(directory, "/", name, ".csr");
    commands.push_back(with({openssl, "req"}, with(ec, {"-keyout", key, "-out", request, "-subj",
                                                        absl::StrCat("/CN=moesnap-test-", name)})));
    commands.push_back({openssl, "x509", "-req", "-in", request, "-CA", files.ca_file, "-CAkey",
                        ca_key, "-set_serial", std::to_string(serial++), "-days", "2", "-out", cert,
                        "-extfile", absl::StrCat(directory, "/", name, ".ext")});
  }
  for (const std::vector<std::string>& command : commands) {
    if (absl::Status status = RunCommand(command); !status.ok()) return status;
  }
  return files;
}

EtcdCluster::EtcdCluster(Options options) : options_(std::move(options)) {
  static std::atomic<int> counter{0};
  char directory[] = "/tmp/moesnap-etcd-XXXXXX";
  directory_ = mkdtemp(directory);
  cluster_token_ = absl::StrCat("moesnap-test-", getpid(), "-", counter++);
  members_.resize(options_.members);
  for (int i = 0; i < options_.members; ++i) {
    Member& member = members_[i];
    member.name = absl::StrCat("member", i);
    member.data_directory = absl::StrCat(directory_, "/", member.name);
    member.log_file = absl::StrCat(directory_, "/", member.name, ".log");
  }
}

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(const Options& options) {
  if (options.members < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("an etcd cluster needs at least one member, got ", options.members));
  }
  if (!options.placements.empty() && options.placements.size() != size_t(options.members)) {
    return absl::InvalidArgumentError(absl::StrCat("an etcd cluster of ", options.members,
                                                   " members placed on ", options.placements.size(),
                                                   " hosts"));
  }
  std::unique_ptr<EtcdCluster> cluster(new EtcdCluster(options));
  // A port chosen free may be taken by another process before etcd binds it: try fresh ports.
  absl::Status launched;
  for (int attempt = 0; attempt < 3; ++attempt) {
    launched = cluster->Launch();
    if (launched.ok()) return cluster;
    cluster->KillAll();
  }
  return launched;
}

EtcdCluster::~EtcdCluster() {
  KillAll();
  std::error_code ignored;
  std::filesystem::remove_all(directory_, ignored);
}

void EtcdCluster::KillAll() {
  for (Member& member : members_) member.process.reset();  // ChildProcess SIGKILLs and reaps
}

std::vector<std::string> EtcdCluster::endpoints() const {
  std::vector<std::string> all;
  for (const Member& member : members_) all.push_back(member.client_endpoint);
  return all;
}

etcd::Options EtcdCluster::ClientOptions() const {
  return etcd::Options{.endpoints = endpoints(),
                       .call_timeout = absl::Seconds(10),
                       .attempt_timeout = absl::Seconds(2),
                       .dial_timeout = absl::Milliseconds(500),
                       .tls = options_.client_tls};
}

std::vector<std::string> EtcdCluster::Arguments(int index) const {
  const Member& member = members_[index];
  const bool tls = !options_.server_cert_file.empty();
  const std::string client_url = absl::StrCat(tls ? "https://" : "http://", member.client_endpoint);
  std::vector<std::string> initial_cluster;
  for (const Member& each : members_) {
    initial_cluster.push_back(absl::StrCat(each.name, "=", each.peer_url));
  }
  std::vector<std::string> arguments = {
      // setpriv (util-linux) execs etcd with a parent-death signal, so a test that crashes before
      // its destructor runs leaves no member behind.
      "/usr/bin/setpriv", "--pdeathsig", "KILL", "--", MOESNAP_ETCD_BINARY,
      "--name", member.name,
      "--data-dir", member.data_directory,
      "--listen-client-urls", client_url,
      "--advertise-client-urls", client_url,
      "--listen-peer-urls", member.peer_url,
      "--initial-advertise-peer-urls", member.peer_url,
      "--initial-cluster", absl::StrJoin(initial_cluster, ","),
      "--initial-cluster-token", cluster_token_,
      "--initial-cluster-state", "new",
      "--heartbeat-interval", std::to_string(options_.heartbeat_ms),
      "--election-timeout", std::to_string(options_.election_ms),
      "--logger", "zap",
      "--log-level", "warn",
      "--log-outputs", member.log_file};
  if (!options_.fsync) arguments.push_back("--unsafe-no-fsync");
  if (tls) {
    arguments.insert(arguments.end(), {"--cert-file", options_.server_cert_file, "--key-file",
                                       options_.server_key_file});
  }
  if (!options_.client_ca_file.empty()) {
    arguments.insert(arguments.end(),
                     {"--client-cert-auth", "--trusted-ca-file", options_.client_ca_file});
  }
  return arguments;
}

void EtcdCluster::Spawn(int index) {
  Member& member = members_[index];
  member.stopped = false;
  std::vector<std::string> argv =
      options_.placements.empty() ? std::vector<std::string>{} : options_.placements[index].launcher;
  const std::vector<std::string> arguments = Arguments(index);
  argv.insert(argv.end(), arguments.begin(), arguments.end());
  member.process = std::make_unique<ChildProcess>(argv);
}

absl::Status EtcdCluster::Launch() {
  std::set<uint16_t> ports;
  while (options_.placements.empty() && ports.size() < 2 * members_.size()) {
    if (const uint16_t port = UnusedLoopbackPort(); port != 0) ports.insert(port);
  }
  auto port = ports.begin();
  for (int i = 0; i < size(); ++i) {
    Member& member = members_[i];
    if (options_.placements.empty()) {
      member.client_endpoint = absl::StrCat("127.0.0.1:", *port++);
      member.peer_url = absl::StrCat("http://127.0.0.1:", *port++);
    } else {  // a host of its own: etcd's usual ports are free there
      member.client_endpoint = absl::StrCat(options_.placements[i].address, ":2379");
      member.peer_url = absl::StrCat("http://", options_.placements[i].address, ":2380");
    }
    std::error_code ignored;
    std::filesystem::remove_all(member.data_directory, ignored);
    std::filesystem::remove(member.log_file, ignored);
  }
  for (int i = 0; i < size(); ++i) Spawn(i);
  const absl::Status healthy = WaitHealthy(absl::Seconds(30));
  if (!healthy.ok()) return healthy;
  for (int i = 0; i < size(); ++i) {
    absl::StatusOr<etcd::MemberStatus> status = StatusOf(i);
    if (!status.ok()) return status.status();
    members_[i].id = status->member_id;
  }
  return absl::OkStatus();
}

absl::StatusOr<etcd::MemberStatus> EtcdCluster::StatusOf(int member) const {
  etcd::Options options = ClientOptions();
  options.endpoints = {members_[member].client_endpoint};
  options.call_timeout = absl::Milliseconds(500);
  options.attempt_timeout = absl::Milliseconds(500);
  options.dial_timeout = absl::Milliseconds(200);
  absl::StatusOr<std::unique_ptr<etcd::Client>> client = etcd::Client::Create(options);
  if (!client.ok()) return client.status();
  return (*client)->Status();
}

absl::Status EtcdCluster::WaitHealthy(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string last_problem = "not checked yet";
  while (absl::Now() < deadline) {
    std::set<uint64_t> leaders;
    std::vector<std::string> serving;
    bool all_answer = true;
    for (int i = 0; i < size(); ++i) {
      if (members_[i].stopped || members_[i].process == nullptr) continue;
      if (!running(i)) {
        if (members_[i].id == 0) {  // never served: it failed to start
          return absl::UnavailableError(
              absl::StrCat("etcd ", members_[i].name, " exited at start: ", LogTail(i)));
        }
        continue;
      }
      absl::StatusOr<etcd::MemberStatus> status = StatusOf(i);
      if (!status.ok() || status->leader_id == 0) {
        all_answer = false;
        last_problem = absl::StrCat(members_[i].name, ": ",
                                    status.ok() ? "no leader" : status.status().ToString());
        break;
      }
      leaders.insert(status->leader_id);
      serving.push_back(members_[i].client_endpoint);
    }
    if (all_answer && leaders.size() == 1) {
      etcd::Options options = ClientOptions();
      options.endpoints = serving;
      options.call_timeout = absl::Seconds(1);
      absl::StatusOr<std::unique_ptr<etcd::Client>> client = etcd::Client::Create(options);
      if (!client.ok()) return client.status();
      absl::StatusOr<std::optional<etcd::KeyValue>> read = (*client)->Get("moesnap-test-health");
      if (read.ok()) return absl::OkStatus();
      last_problem = read.status().ToString();
    } else if (all_answer) {
      last_problem = absl::StrCat("members disagree on the leader (", leaders.size(), " leaders)");
    }
    absl::SleepFor(kPollInterval);
  }
  std::string logs;
  for (int i = 0; i < size(); ++i) absl::StrAppend(&logs, "\n", members_[i].name, ": ", LogTail(i));
  return absl::DeadlineExceededError(absl::StrCat(
      "etcd not healthy within ", absl::FormatDuration(timeout), ": ", last_problem, logs));
}

absl::Status EtcdCluster::Kill(int member) {
  if (!running(member)) {
    return absl::FailedPreconditionError(absl::StrCat(members_[member].name, " is not running"));
  }
  members_[member].process->Kill(SIGKILL);
  members_[member].stopped = false;
  return absl::OkStatus();
}

absl::Status EtcdCluster::Stop(int member) {
  if (!running(member)) {
    return absl::FailedPreconditionError(absl::StrCat(members_[member].name, " is not running"));
  }
  const pid_t pid = members_[member].process->pid();
  ::kill(pid, SIGSTOP);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (ProcessState(pid) != 'T') {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(members_[member].name, " did not stop"));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  members_[member].stopped = true;
  return absl::OkStatus();
}

absl::Status EtcdCluster::Continue(int member) {
  if (!running(member)) {
    return absl::FailedPreconditionError(absl::StrCat(members_[member].name, " is not running"));
  }
  ::kill(members_[member].process->pid(), SIGCONT);
  members_[member].stopped = false;
  return absl::OkStatus();
}

absl::Status EtcdCluster::Restart(int member, absl::Duration timeout) {
  if (running(member)) {
    return absl::FailedPreconditionError(
        absl::StrCat(members_[member].name, " still runs; Kill it first"));
  }
  Spawn(member);
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last = absl::UnknownError("not checked yet");
  while (absl::Now() < deadline) {
    if (!running(member)) {
      return absl::UnavailableError(
          absl::StrCat(members_[member].name, " exited after restart: ", LogTail(member)));
    }
    absl::StatusOr<etcd::MemberStatus> status = StatusOf(member);
    if (status.ok() && status->leader_id != 0) return absl::OkStatus();
    last = status.ok() ? absl::UnavailableError("no leader yet") : status.status();
    absl::SleepFor(kPollInterval);
  }
  return absl::DeadlineExceededError(
      absl::StrCat(members_[member].name, " not serving within ", absl::FormatDuration(timeout),
                   " of restart: ", last.ToString(), "; ", LogTail(member)));
}

bool EtcdCluster::running(int member) {
  return members_[member].process != nullptr && members_[member].process->running();
}

absl::StatusOr<int> EtcdCluster::Leader(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    // A member that believes it leads, with the highest term if an old leader has not noticed yet.
    int leader = -1;
    uint64_t term = 0;
    for (int i = 0; i < size(); ++i) {
      if (members_[i].stopped || !running(i)) continue;
      absl::StatusOr<etcd::MemberStatus> status = StatusOf(i);
      if (status.ok() && status->leader_id == status->member_id && status->raft_term >= term) {
        leader = i;
        term = status->raft_term;
      }
    }
    if (leader >= 0) return leader;
    absl::SleepFor(kPollInterval);
  }
  return absl::DeadlineExceededError(
      absl::StrCat("no etcd member leads within ", absl::FormatDuration(timeout)));
}

std::string EtcdCluster::LogTail(int member, size_t bytes) const {
  std::ifstream log(members_[member].log_file);
  std::string contents((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  return contents.size() > bytes ? contents.substr(contents.size() - bytes) : contents;
}

}  // namespace moesnap::testing
