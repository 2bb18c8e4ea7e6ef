// The cluster section of the config: groups formed from node ids below node_count, a digest that two
// daemons agree on exactly when their jobs agree (whatever their own addresses), differences named,
// malformed clusters refused by key, and this node's id and address taken from the command line or
// the environment over the file.
#include "daemon/cluster_config.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/config.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

std::string SixNodes(const std::string& extra = "") {
  return "[node]\nid = 4\n[cluster]\njob = \"train-42\"\nnode_count = 6\ndata_units = 4\n"
         "parity_units = 2\netcd_endpoints = [\"10.0.0.1:2379\", \"10.0.0.2:2379\"]\n"
         "advertise_host = \"10.0.1.4\"\n" +
         extra +
         "[tls]\nca_file = \"ca.pem\"\ncert_file = \"node-{node}.pem\"\n"
         "key_file = \"node-{node}.key\"\n";
}

TEST(ClusterConfigTest, ParsesTheJobAndFormsGroupsById) {
  absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(SixNodes(), "cluster.toml");
  ASSERT_OK(options);
  ASSERT_TRUE(options->cluster.has_value());
  const ClusterOptions& cluster = *options->cluster;
  EXPECT_EQ(cluster.job, "train-42");
  EXPECT_EQ(cluster.Groups(), (std::vector<std::vector<uint32_t>>{{0, 1, 2, 3, 4, 5}}));
  EXPECT_EQ(cluster.GroupOf(4), (std::pair<int, int>(0, 4)));
  EXPECT_EQ(cluster.GroupOf(6), std::nullopt);
  EXPECT_EQ(cluster.etcd_endpoints, (std::vector<std::string>{"10.0.0.1:2379", "10.0.0.2:2379"}));
  EXPECT_EQ(cluster.control_port, 7440);
  EXPECT_EQ(cluster.ListenHost(), "10.0.1.4");  // an address listens where it is advertised
  EXPECT_OK(cluster.Validate(4));
  ClusterOptions named = cluster;
  named.advertise_host = "node-4.train-42.svc";
  EXPECT_EQ(named.ListenHost(), "0.0.0.0");  // a name may resolve to any of this host's addresses
  absl::StatusOr<DaemonOptions> single = ParseDaemonOptions("", "single.toml");
  ASSERT_OK(single);
  EXPECT_FALSE(single->cluster.has_value());
}

TEST(ClusterConfigTest, DigestAgreesExactlyWhenJobsAgree) {
  absl::StatusOr<DaemonOptions> a = ParseDaemonOptions(SixNodes(), "a.toml");
  absl::StatusOr<DaemonOptions> elsewhere = ParseDaemonOptions(
      absl::StrCat("[node]\nid = 1\n",
                   SixNodes("control_port = 9000\n").substr(SixNodes().find("[cluster]"))),
      "b.toml");
  absl::StatusOr<DaemonOptions> other_unit =
      ParseDaemonOptions(SixNodes("stripe_unit_bytes = \"1MiB\"\n"), "c.toml");
  ASSERT_OK(a);
  ASSERT_OK(elsewhere);
  ASSERT_OK(other_unit);
  // Another node of the job, on its own port: the same job.
  EXPECT_EQ(a->cluster->Digest(), elsewhere->cluster->Digest());
  EXPECT_EQ(a->cluster->DifferenceFrom(*elsewhere->cluster), "");
  EXPECT_NE(a->cluster->Digest(), other_unit->cluster->Digest());
  EXPECT_EQ(a->cluster->DifferenceFrom(*other_unit->cluster),
            "stripe_unit_bytes: 4194304 here, 1048576 there");
  ClusterOptions bigger = *a->cluster;
  bigger.node_count = 12;
  EXPECT_EQ(a->cluster->DifferenceFrom(bigger), "node_count: 6 here, 12 there");
}

TEST(ClusterConfigTest, MalformedClustersAreRefusedByKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[cluster]\ndata_units = 4\n", "cluster.node_count: a cluster needs the number of nodes"},
      {"[cluster]\nnode_count = 5\ndata_units = 4\nparity_units = 2\n",
       "5 nodes cannot form groups of k + m = 6"},
      {"[cluster]\nnode_count = 2\ndata_units = 1\nparity_units = 1\n[[cluster.nodes]]\nid = 0\n",
       "nodes are no longer listed"},
      {"[cluster]\nnode_count = 2\ndata_units = 1\nparity_units = 1\ncontrol_port = 70000\n",
       "cluster.control_port"},
      {"[cluster]\nnode_count = 2\ndata_units = 1\nparity_units = 1\njob = \"a/b\"\n",
       "cluster.job must be"},
      {"[cluster]\nnode_count = 2\ndata_units = 1\nparity_units = 1\netcd_endpoints = []\n",
       "cluster.etcd_endpoints"},
      {"[cluster]\nnode_count = 2\ndata_units = 1\nparity_units = 1\netcd_endpoints = [7]\n",
       "cluster.etcd_endpoints: expected an array of strings"},
      {"[cluster]\nnode_count = 2\ndata_units = 1\nparity_units = 1\nlease_ttl_ms = 500\n",
       "cluster.lease_ttl_ms"},
      {"[cluster]\nnode_count = 2\ndata_units = 1\nparity_units = 1\netcd_cert_file = \"c.pem\"\n",
       "go together"},
      {"[cluster]\nnode_count = 2\nstripe_unit_bytes = 100\n", "multiple of 64"},
      {"[cluster]\nallow_degraded = \"yes\"\n", "cluster.allow_degraded"},
      {"[cluster]\nnode_count = 6\nrestore_buffer_bytes = \"64KiB\"\n",
       "cluster.restore_buffer_bytes: must be at least 1048576 bytes, got 65536"},
      {"[cluster]\nnode_count = 6\nk = 4\n", "unknown key cluster.k"},
      {"[cluster]\nnode_count = 6\nheartbeat_timeout_ms = 2000\n",
       "unknown key cluster.heartbeat_timeout_ms"},
  };
  for (const auto& [text, mentions] : cases) {
    absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(text, "bad.toml");
    ASSERT_STATUS(options, absl::StatusCode::kInvalidArgument) << text;
    EXPECT_TRUE(absl::StrContains(options.status().message(), mentions))
        << options.status() << "\nshould mention: " << mentions;
    EXPECT_TRUE(absl::StrContains(options.status().message(), "bad.toml")) << options.status();
  }
}

// One file for every node of a job: the node's id and address come from the command line or the
// environment, and are checked against the job once known.
TEST(ClusterConfigTest, NodeIdentityComesFromFlagsOrTheEnvironment) {
  const std::string shared =
      "[cluster]\nnode_count = 6\ndata_units = 4\nparity_units = 2\n[tls]\n"
      "ca_file = \"tls/ca.pem\"\ncert_file = \"tls/node-{node}.pem\"\n"
      "key_file = \"tls/node-{node}.key\"\n";
  absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(shared, "job.toml");
  ASSERT_OK(options);
  // Without an address to advertise, a cluster node cannot start.
  EXPECT_TRUE(absl::StrContains(ApplyNodeIdentity({}, &*options).message(), "advertise_host"));

  setenv("MOESNAP_NODE_ID", "5", 1);
  setenv("MOESNAP_ADVERTISE_HOST", "worker-5.example", 1);
  absl::StatusOr<NodeIdentity> identity = NodeIdentityFromEnvironment();
  ASSERT_OK(identity);
  EXPECT_EQ(identity->node_id, 5u);
  ASSERT_OK(ApplyNodeIdentity(*identity, &*options));
  EXPECT_EQ(options->node_id, 5u);
  EXPECT_EQ(options->cluster->advertise_host, "worker-5.example");
  // The same [tls] names each node's own files.
  EXPECT_EQ(options->cluster->NodeTls(5).cert_file, "tls/node-5.pem");
  EXPECT_EQ(options->cluster->NodeTls(5).key_file, "tls/node-5.key");
  EXPECT_EQ(options->cluster->NodeTls(5).ca_file, "tls/ca.pem");

  // A flag wins over the environment; an id outside the job is refused.
  identity->node_id = 6;
  EXPECT_TRUE(absl::StrContains(ApplyNodeIdentity(*identity, &*options).message(),
                                "node id 6 is not below cluster.node_count = 6"));
  setenv("MOESNAP_NODE_ID", "five", 1);
  EXPECT_STATUS(NodeIdentityFromEnvironment(), absl::StatusCode::kInvalidArgument);
  unsetenv("MOESNAP_NODE_ID");
  unsetenv("MOESNAP_ADVERTISE_HOST");
}

// The example config documents the cluster section commented out; uncommented, it must load and
// show exactly the defaults (but the two keys it must give: the node count and the address).
TEST(ClusterConfigTest, TheDocumentedClusterSectionLoadsWithTheDefaults) {
  std::ifstream file(std::string(MOESNAP_SOURCE_DIR) + "/deploy/moesnapd.toml");
  std::stringstream text;
  text << file.rdbuf();
  const std::string example = text.str();
  const size_t start = example.find("# [cluster]\n");
  ASSERT_NE(start, std::string::npos);
  std::string section;
  std::istringstream lines(example.substr(start));
  for (std::string line; std::getline(lines, line);) {
    // "# key = value" is a key; "# # words" is a comment of the section.
    if (line.rfind("# ", 0) == 0 && line.rfind("# #", 0) != 0) section += line.substr(2) + "\n";
  }
  absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(section, "moesnapd.toml");
  ASSERT_OK(options);
  ASSERT_TRUE(options->cluster.has_value());
  const ClusterOptions defaults;
  const ClusterOptions& documented = *options->cluster;
  EXPECT_EQ(documented.job, defaults.job);
  EXPECT_EQ(documented.etcd_endpoints, defaults.etcd_endpoints);
  EXPECT_EQ(documented.etcd_ca_file, defaults.etcd_ca_file);
  EXPECT_EQ(documented.data_units, defaults.data_units);
  EXPECT_EQ(documented.parity_units, defaults.parity_units);
  EXPECT_EQ(documented.stripe_unit_bytes, defaults.stripe_unit_bytes);
  EXPECT_EQ(documented.lease_ttl_ms, defaults.lease_ttl_ms);
  EXPECT_EQ(documented.commit_timeout_ms, defaults.commit_timeout_ms);
  EXPECT_EQ(documented.allow_degraded, defaults.allow_degraded);
  EXPECT_EQ(documented.listen_host, defaults.listen_host);
  EXPECT_EQ(documented.control_port, defaults.control_port);
  EXPECT_EQ(documented.data_port, defaults.data_port);
  EXPECT_EQ(documented.max_data_connections, defaults.max_data_connections);
  EXPECT_EQ(documented.restore_buffer_bytes, defaults.restore_buffer_bytes);
  EXPECT_EQ(documented.tls.insecure, defaults.tls.insecure);
  EXPECT_FALSE(documented.tls.insecure);
  EXPECT_OK(documented.Validate(0));
}

// A cluster's peers authenticate with mutual TLS unless the operator says plaintext, and plaintext
// only on loopback; etcd is reached with the node's own files unless the etcd_* keys name others.
TEST(ClusterConfigTest, PeersNeedMutualTlsUnlessPlaintextOnLoopback) {
  const std::string job =
      "[cluster]\nnode_count = 2\ndata_units = 1\nparity_units = 1\nadvertise_host = ";
  auto node0 = [&](const std::string& rest) -> absl::Status {
    absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(job + rest, "job.toml");
    if (!options.ok()) return options.status();
    return ApplyNodeIdentity({}, &*options);
  };
  const absl::Status no_tls = node0("\"127.0.0.1\"\n");
  EXPECT_STATUS(no_tls, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(no_tls.message(),
                                "tls.ca_file, tls.cert_file, tls.key_file are not set"))
      << no_tls;
  const absl::Status no_key =
      node0("\"127.0.0.1\"\n[tls]\nca_file = \"ca.pem\"\ncert_file = \"n.pem\"\n");
  EXPECT_TRUE(absl::StrContains(no_key.message(), "tls.key_file is not set")) << no_key;
  EXPECT_OK(node0("\"127.0.0.1\"\n[tls]\ninsecure = true\n"));
  EXPECT_OK(node0("\"::1\"\n[tls]\ninsecure = true\n"));
  const absl::Status network = node0("\"10.0.0.3\"\n[tls]\ninsecure = true\n");
  EXPECT_TRUE(absl::StrContains(network.message(), "loopback only, and this node listens on "
                                                   "10.0.0.3"))
      << network;
  const absl::Status both =
      node0("\"127.0.0.1\"\n[tls]\ninsecure = true\nca_file = \"ca.pem\"\n");
  EXPECT_TRUE(absl::StrContains(both.message(), "choose one")) << both;
  // [tls] belongs to a cluster.
  EXPECT_TRUE(absl::StrContains(
      ParseDaemonOptions("[tls]\ninsecure = true\n", "one.toml").status().message(),
      "this config has no [cluster]"));

  absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(
      job + "\"10.0.0.3\"\n[tls]\nca_file = \"ca.pem\"\ncert_file = \"node-{node}.pem\"\n"
            "key_file = \"node-{node}.key\"\n",
      "job.toml");
  ASSERT_OK(options);
  EXPECT_EQ(options->cluster->EtcdTls(1).ca_file, "ca.pem");
  EXPECT_EQ(options->cluster->EtcdTls(1).cert_file, "node-1.pem");
  options->cluster->etcd_ca_file = "etcd-ca.pem";
  EXPECT_EQ(options->cluster->EtcdTls(1).ca_file, "etcd-ca.pem");
  EXPECT_EQ(options->cluster->EtcdTls(1).cert_file, "");
}

}  // namespace
}  // namespace moesnap::daemon
