#include "tests/testing/net_lab.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "tests/testing/child_process.h"

namespace moesnap::testing {
namespace {

constexpr int kCapNetAdmin = 12;
constexpr int kCapSysAdmin = 21;
constexpr char kNamespacePrefix[] = "moesnap-lab-";
constexpr char kBridgePrefix[] = "msb";
constexpr char kLinkPrefix[] = "msv";
constexpr char kPeerPrefix[] = "msp";

std::string IpBinary() {
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(path, X_OK) == 0) return path;
  }
  return "";
}

// The effective capability set of this process, from /proc/self/status.
uint64_t EffectiveCapabilities() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (absl::string_view rest = line; absl::ConsumePrefix(&rest, "CapEff:")) {
      uint64_t capabilities = 0;
      return absl::SimpleHexAtoi(absl::StripAsciiWhitespace(rest), &capabilities) ? capabilities
                                                                                    : 0;
    }
  }
  return 0;
}

// Runs `ip` with `arguments`; its output, or why it failed.
absl::StatusOr<std::string> Ip(const std::vector<std::string>& arguments) {
  std::vector<std::string> argv = {IpBinary()};
  argv.insert(argv.end(), arguments.begin(), arguments.end());
  ChildProcess process(argv, {}, ChildProcess::Stderr::kCapture);
  std::string output;
  while (std::optional<std::string> line = process.ReadLine(std::chrono::seconds(20))) {
    absl::StrAppend(&output, *line, "\n");
  }
  const std::optional<int> code = process.Wait(std::chrono::seconds(20));
  if (code == 0) return output;
  return absl::InternalError(absl::StrCat("'", absl::StrJoin(argv, " "), "' exited with ",
                                          code ? std::to_string(*code) : "no exit", ": ", output));
}

bool ProcessExists(pid_t pid) { return kill(pid, 0) == 0 || errno != ESRCH; }

// The creating process of a lab object named `name` after `prefix` (pid in 6 hex digits), or 0.
pid_t CreatorOfLink(absl::string_view name, absl::string_view prefix) {
  if (!absl::ConsumePrefix(&name, prefix) || name.size() < 6) return 0;
  uint32_t pid = 0;
  return absl::SimpleHexAtoi(name.substr(0, 6), &pid) ? static_cast<pid_t>(pid) : 0;
}

// Removes what labs of processes that are gone left behind (a test that crashed).
void RemoveAbandonedLabs() {
  if (absl::StatusOr<std::string> namespaces = Ip({"netns", "list"}); namespaces.ok()) {
    for (absl::string_view line : absl::StrSplit(*namespaces, '\n', absl::SkipEmpty())) {
      const std::string name(line.substr(0, line.find(' ')));
      absl::string_view rest = name;
      if (!absl::ConsumePrefix(&rest, kNamespacePrefix)) continue;
      uint32_t pid = 0;
      if (!absl::SimpleAtoi(rest.substr(0, rest.find('-')), &pid) || ProcessExists(pid)) continue;
      (void)Ip({"netns", "delete", name});
      std::error_code ignored;
      std::filesystem::remove_all("/etc/netns/" + name, ignored);
    }
  }
  if (absl::StatusOr<std::string> links = Ip({"-o", "link", "show"}); links.ok()) {
    for (absl::string_view line : absl::StrSplit(*links, '\n', absl::SkipEmpty())) {
      // "12: msv0012ab003@if11: <BROADCAST,..." -> "msv0012ab003"
      const std::vector<absl::string_view> fields = absl::StrSplit(line, absl::MaxSplits(": ", 2));
      if (fields.size() < 2) continue;
      const std::string name(fields[1].substr(0, fields[1].find('@')));
      for (const char* prefix : {kBridgePrefix, kLinkPrefix, kPeerPrefix}) {
        const pid_t pid = CreatorOfLink(name, prefix);
        if (pid != 0 && !ProcessExists(pid)) (void)Ip({"link", "delete", name});
      }
    }
  }
}

// A 10.a.b.0/24 that no address of this machine is in.
absl::StatusOr<std::string> FreeSubnet(int lab) {
  absl::StatusOr<std::string> addresses = Ip({"-4", "-o", "addr", "show"});
  if (!addresses.ok()) return addresses.status();
  const uint32_t seed = static_cast<uint32_t>(getpid()) * 131 + static_cast<uint32_t>(lab) * 7;
  for (uint32_t attempt = 0; attempt < 512; ++attempt) {
    const uint32_t pick = (seed + attempt * 2654435761u) % (200 * 256);
    const std::string prefix = absl::StrCat("10.", 40 + pick / 256, ".", pick % 256, ".");
    if (addresses->find(" " + prefix) == std::string::npos) return prefix;
  }
  return absl::ResourceExhaustedError("no free 10.x.y.0/24 subnet for a network lab");
}

}  // namespace

std::string NetLab::Unavailable() {
  if (IpBinary().empty()) return "no `ip` program (iproute2) to make network namespaces";
  const uint64_t capabilities = EffectiveCapabilities();
  if ((capabilities & (uint64_t{1} << kCapNetAdmin)) == 0) {
    return "network namespaces need CAP_NET_ADMIN, which this process lacks (run as root)";
  }
  if ((capabilities & (uint64_t{1} << kCapSysAdmin)) == 0) {
    return "`ip netns` needs CAP_SYS_ADMIN to mount namespaces, which this process lacks";
  }
  return "";
}

absl::StatusOr<std::unique_ptr<NetLab>> NetLab::Create(int hosts) {
  if (std::string why = Unavailable(); !why.empty()) return absl::FailedPreconditionError(why);
  if (hosts < 1 || hosts > 250) {
    return absl::InvalidArgumentError(absl::StrCat("a lab has 1 to 250 hosts, not ", hosts));
  }
  std::unique_ptr<NetLab> lab(new NetLab());
  if (absl::Status built = lab->Build(hosts); !built.ok()) return built;
  return lab;
}

absl::Status NetLab::Build(int hosts) {
  static std::atomic<int> counter{0};
  const int lab = counter++;
  RemoveAbandonedLabs();
  absl::StatusOr<std::string> prefix = FreeSubnet(lab);
  if (!prefix.ok()) return prefix.status();
  prefix_ = *prefix;
  const std::string tag = absl::StrFormat("%06x%x", getpid(), lab % 16);
  bridge_ = absl::StrCat(kBridgePrefix, tag);
  bridge_address_ = prefix_ + "254";
  for (const std::vector<std::string>& command :
       {std::vector<std::string>{"link", "add", bridge_, "type", "bridge"},
        {"addr", "add", bridge_address_ + "/24", "dev", bridge_},
        {"link", "set", bridge_, "up"}}) {
    if (absl::StatusOr<std::string> done = Ip(command); !done.ok()) return done.status();
    bridge_made_ = true;
  }
  for (int i = 0; i < hosts; ++i) {
    hosts_.push_back({.netns = absl::StrCat(kNamespacePrefix, getpid(), "-", lab, "-h", i),
                      .link = absl::StrFormat("%s%s%02x", kLinkPrefix, tag, i),
                      .address = absl::StrCat(prefix_, i + 1),
                      .hostname = absl::StrCat("host", i)});
  }
  // Every host resolves every host's name (and the bridge's, "gateway").
  std::string hosts_file = "127.0.0.1 localhost\n";
  for (const Host& host : hosts_) absl::StrAppend(&hosts_file, host.address, " ", host.hostname, "\n");
  absl::StrAppend(&hosts_file, bridge_address_, " gateway\n");
  for (int i = 0; i < hosts; ++i) {
    const Host& host = hosts_[i];
    const std::string peer = absl::StrFormat("%s%s%02x", kPeerPrefix, tag, i);
    const std::string directory = "/etc/netns/" + host.netns;
    std::error_code error;
    std::filesystem::create_directories(directory, error);
    if (error) {
      return absl::InternalError(absl::StrCat("cannot make ", directory, ": ", error.message()));
    }
    std::ofstream(directory + "/hosts") << hosts_file;
    for (const std::vector<std::string>& command : {
             std::vector<std::string>{"netns", "add", host.netns},
             {"link", "add", host.link, "type", "veth", "peer", "name", peer},
             {"link", "set", peer, "netns", host.netns},
             {"link", "set", host.link, "master", bridge_, "up"},
             {"-n", host.netns, "link", "set", peer, "name", "eth0"},
             {"-n", host.netns, "addr", "add", host.address + "/24", "dev", "eth0"},
             {"-n", host.netns, "link", "set", "eth0", "up"},
             {"-n", host.netns, "link", "set", "lo", "up"}}) {
      if (absl::StatusOr<std::string> done = Ip(command); !done.ok()) return done.status();
    }
  }
  return absl::OkStatus();
}

NetLab::~NetLab() { TearDown(); }

void NetLab::TearDown() {
  for (const Host& host : hosts_) {
    (void)Ip({"link", "delete", host.link});  // both ends of the pair go
    (void)Ip({"netns", "delete", host.netns});
    std::error_code ignored;
    std::filesystem::remove_all("/etc/netns/" + host.netns, ignored);
  }
  if (bridge_made_) (void)Ip({"link", "delete", bridge_});
}

std::vector<std::string> NetLab::Launch(int host, const std::vector<std::string>& argv) const {
  std::vector<std::string> command = {IpBinary(), "netns", "exec", hosts_[host].netns};
  command.insert(command.end(), argv.begin(), argv.end());
  return command;
}

absl::Status NetLab::Disconnect(int host) {
  absl::StatusOr<std::string> done = Ip({"link", "set", hosts_[host].link, "down"});
  return done.ok() ? absl::OkStatus() : done.status();
}

absl::Status NetLab::Reconnect(int host) {
  absl::StatusOr<std::string> done = Ip({"link", "set", hosts_[host].link, "up"});
  return done.ok() ? absl::OkStatus() : done.status();
}

}  // namespace moesnap::testing
