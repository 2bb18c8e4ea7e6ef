// Real etcd for tests: a 1- or 3-member etcd (Debian's etcd-server) on free loopback ports, with
// its data and logs in a fresh temporary folder, started as child processes that a test can
// SIGKILL, SIGSTOP, SIGCONT and restart. Start returns once every member serves (a condition
// polled, never a fixed sleep); Leader finds the raft leader. The destructor kills every member and
// removes the folder.
//
//   Use:
//     auto etcd = EtcdCluster::Start({.members = 3});
//     ASSERT_TRUE(etcd.ok()) << etcd.status();
//     auto client = etcd::Client::Create((*etcd)->ClientOptions());
//     ...
//     absl::StatusOr<int> leader = (*etcd)->Leader();
//     (*etcd)->Kill(*leader);   // the client goes on through the other two members
//
// Members write without fsync (--unsafe-no-fsync) unless Options::fsync, which is for measuring.
// Each member's log is <directory>/member<i>.log; LogTail shows its end in failure messages.
// Not thread-safe: one test thread drives a cluster. Members die with the thread that started them
// (a parent-death signal, so that a crashed test leaves none behind): call Start and Restart from a
// thread that outlives the cluster, such as the test's own.
#ifndef MOESNAP_TESTS_TESTING_ETCD_PROCESS_H_
#define MOESNAP_TESTS_TESTING_ETCD_PROCESS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/etcd/etcd_client.h"
#include "tests/testing/child_process.h"

namespace moesnap::testing {

// A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl, for tests
// of TLS and mutual TLS.
struct TestCertificates {
  std::string ca_file{};
  std::string server_cert_file{};
  std::string server_key_file{};
  std::string client_cert_file{};
  std::string client_key_file{};
};
// Writes the certificates into `directory` (which must exist).
absl::StatusOr<TestCertificates> MakeTestCertificates(const std::string& directory);

class EtcdCluster {
 public:
  struct Options {
    int members = 1;  // 1 or 3 (any odd count works)
    bool fsync = false;
    // Raft timing; etcd's minimum lease TTL is 1.5 election timeouts (1000 ms: 2 s leases).
    int heartbeat_ms = 100;
    int election_ms = 1000;
    // Serve clients over TLS with this certificate and key; with client_ca_file, require client
    // certificates signed by it (mutual TLS). client_tls is what ClientOptions (and the cluster's
    // own health checks) use.
    std::string server_cert_file{};
    std::string server_key_file{};
    std::string client_ca_file{};
    etcd::TlsOptions client_tls{};
    // Where each member runs, for tests on a network of their own (tests/testing/net_lab.h): its
    // address (it serves clients on port 2379 and peers on 2380 there) and the command prefix
    // that runs a program on its host. Empty: every member on free loopback ports here.
    struct Placement {
      std::string address{};
      std::vector<std::string> launcher{};
    };
    std::vector<Placement> placements{};
  };

  // Starts the members and waits until they serve (up to 30 s). Retries with other ports if one
  // was taken meanwhile.
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start(const Options& options);
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start() { return Start(Options{}); }
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  // "address:port" of each member's client URL, in member order.
  std::vector<std::string> endpoints() const;
  const std::string& endpoint(int member) const { return members_[member].client_endpoint; }
  // Every endpoint, the client TLS files, and timeouts short enough for tests.
  etcd::Options ClientOptions() const;
  const std::string& directory() const { return directory_; }

  // SIGKILL, then waits for the exit.
  absl::Status Kill(int member);
  // SIGSTOP / SIGCONT: the member keeps its connections but answers nothing while stopped.
  absl::Status Stop(int member);
  absl::Status Continue(int member);
  // Starts a killed member again on its data and ports; waits until it serves.
  absl::Status Restart(int member, absl::Duration timeout = absl::Seconds(30));
  bool running(int member);

  // The member that is raft leader, as the running, unstopped members see it; waits for one.
  absl::StatusOr<int> Leader(absl::Duration timeout = absl::Seconds(15));
  // Waits until every running, unstopped member knows the same leader and a linearizable read
  // through the cluster succeeds.
  absl::Status WaitHealthy(absl::Duration timeout);

  // The last `bytes` of a member's log.
  std::string LogTail(int member, size_t bytes = 4000) const;

 private:
  struct Member {
    std::string name;
    std::string client_endpoint;
    std::string peer_url;
    std::string data_directory;
    std::string log_file;
    uint64_t id = 0;  // etcd's member id, learned once it serves
    bool stopped = false;
    std::unique_ptr<ChildProcess> process;
  };

  explicit EtcdCluster(Options options);
  // Picks ports, starts every member and waits until they serve.
  absl::Status Launch();
  void Spawn(int member);
  std::vector<std::string> Arguments(int member) const;
  // A client of `member` alone, for status checks.
  absl::StatusOr<etcd::MemberStatus> StatusOf(int member) const;
  void KillAll();

  Options options_;
  std::string directory_;
  std::string cluster_token_;
  std::vector<Member> members_;
};

}  // namespace moesnap::testing

#endif  // MOESNAP_TESTS_TESTING_ETCD_PROCESS_H_
