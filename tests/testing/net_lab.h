// A network lab for tests with real partitions: hosts that are network namespaces of their own, each
// joined by a veth pair to one Linux bridge, with addresses and host names of the lab's own
// (10.a.b.0/24, host i at 10.a.b.(i + 1), named "host<i>"; the bridge, the test process's side, at
// 10.a.b.254). A host is cut off by taking its link down and healed by bringing it up again.
//
//   Use:
//     if (std::string why = NetLab::Unavailable(); !why.empty()) GTEST_SKIP() << why;
//     auto lab = NetLab::Create(4);
//     ASSERT_TRUE(lab.ok()) << lab.status();
//     ChildProcess daemon((*lab)->Launch(0, {"/usr/bin/etcd", ...}));  // runs in host 0
//     (*lab)->Disconnect(0);  // host 0's packets go nowhere, and none reach it
//     (*lab)->Reconnect(0);
//
// Names are unique per lab and carry the creating process's id (namespaces "moesnap-lab-<pid>-<n>-h<i>",
// bridge "msb<pid><n>", links "msv<pid><n><i>"), so parallel test runs do not collide, and a lab left
// behind by a crashed process is removed by the next lab that is created. Host names resolve inside
// the hosts: `ip netns exec` mounts the lab's hosts file over /etc/hosts there. The destructor
// removes the namespaces, links, bridge and hosts files; processes still running in a host keep
// their namespace until they exit, so stop them first.
#ifndef MOESNAP_TESTS_TESTING_NET_LAB_H_
#define MOESNAP_TESTS_TESTING_NET_LAB_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moesnap::testing {

class NetLab {
 public:
  // Empty when labs can be made here; otherwise why not (no CAP_NET_ADMIN or CAP_SYS_ADMIN, no
  // `ip`), for GTEST_SKIP.
  static std::string Unavailable();
  // Makes `hosts` hosts (at most 250) on a fresh bridge.
  static absl::StatusOr<std::unique_ptr<NetLab>> Create(int hosts);
  ~NetLab();
  NetLab(const NetLab&) = delete;
  NetLab& operator=(const NetLab&) = delete;

  int hosts() const { return static_cast<int>(hosts_.size()); }
  const std::string& address(int host) const { return hosts_[host].address; }
  const std::string& hostname(int host) const { return hosts_[host].hostname; }
  const std::string& namespace_name(int host) const { return hosts_[host].netns; }
  // The bridge's own address: where the test process is reached from the hosts.
  const std::string& bridge_address() const { return bridge_address_; }

  // `argv` run inside host `host` (prefixed with `ip netns exec <namespace>`; the program keeps the
  // process id of the command, so signals reach it).
  std::vector<std::string> Launch(int host, const std::vector<std::string>& argv) const;

  // Takes the host's link down: nothing it sends leaves, nothing reaches it.
  absl::Status Disconnect(int host);
  absl::Status Reconnect(int host);

 private:
  struct Host {
    std::string netns;
    std::string link;  // the veth end on the bridge
    std::string address;
    std::string hostname;
  };
  NetLab() = default;
  absl::Status Build(int hosts);
  void TearDown();

  std::string bridge_;
  std::string bridge_address_;
  std::string prefix_;  // "10.a.b."
  std::vector<Host> hosts_;
  bool bridge_made_ = false;
};

}  // namespace moesnap::testing

#endif  // MOESNAP_TESTS_TESTING_NET_LAB_H_
