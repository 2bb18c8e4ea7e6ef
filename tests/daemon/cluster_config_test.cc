// The cluster section of the config: groups formed from node ids, a digest that two daemons agree on
// exactly when their clusters agree, differences named, and malformed clusters refused by key.
#include "daemon/cluster_config.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/config.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

std::string SixNodes(const std::string& extra = "") {
  std::string text = "[node]\nid = 4\n[cluster]\ndata_units = 4\nparity_units = 2\n" + extra;
  // Listed out of order on purpose: groups follow ids, not file order.
  for (int id : {5, 0, 3, 1, 4, 2}) {
    absl::StrAppend(&text, "[[cluster.nodes]]\nid = ", id, "\nhost = \"127.0.0.", id + 1,
                    "\"\ncontrol_port = 7100\ndata_port = 7200\n");
  }
  return text;
}

TEST(ClusterConfigTest, ParsesNodesAndFormsGroupsById) {
  absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(SixNodes(), "cluster.toml");
  ASSERT_OK(options);
  ASSERT_TRUE(options->cluster.has_value());
  EXPECT_EQ(options->cluster->Groups(), (std::vector<std::vector<uint32_t>>{{0, 1, 2, 3, 4, 5}}));
  EXPECT_EQ(options->cluster->GroupOf(4), (std::pair<int, int>(0, 4)));
  EXPECT_EQ(options->cluster->nodes[2].host, "127.0.0.3");
  absl::StatusOr<DaemonOptions> single = ParseDaemonOptions("", "single.toml");
  ASSERT_OK(single);
  EXPECT_FALSE(single->cluster.has_value());
}

TEST(ClusterConfigTest, DigestAgreesExactlyWhenClustersAgree) {
  absl::StatusOr<DaemonOptions> a = ParseDaemonOptions(SixNodes(), "a.toml");
  absl::StatusOr<DaemonOptions> b = ParseDaemonOptions(SixNodes(), "b.toml");
  absl::StatusOr<DaemonOptions> other_unit = ParseDaemonOptions(SixNodes("stripe_unit_bytes = \"1MiB\"\n"), "c.toml");
  ASSERT_OK(a);
  ASSERT_OK(b);
  ASSERT_OK(other_unit);
  EXPECT_EQ(a->cluster->Digest(), b->cluster->Digest());
  EXPECT_EQ(a->cluster->DifferenceFrom(*b->cluster), "");
  EXPECT_NE(a->cluster->Digest(), other_unit->cluster->Digest());
  EXPECT_EQ(a->cluster->DifferenceFrom(*other_unit->cluster),
            "stripe_unit_bytes: 4194304 here, 1048576 there");
  ClusterOptions moved = *a->cluster;
  moved.nodes[3].host = "127.0.0.99";
  EXPECT_NE(a->cluster->Digest(), moved.Digest());
  EXPECT_EQ(a->cluster->DifferenceFrom(moved),
            "node #3: 3@127.0.0.4:7100/7200 here, 3@127.0.0.99:7100/7200 there");
}

TEST(ClusterConfigTest, MalformedClustersAreRefusedByKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[node]\nid = 9\n[cluster]\ndata_units = 1\nparity_units = 1\n"
       "[[cluster.nodes]]\nid = 0\nhost = \"h\"\ncontrol_port = 1\ndata_port = 2\n"
       "[[cluster.nodes]]\nid = 1\nhost = \"h\"\ncontrol_port = 3\ndata_port = 4\n",
       "node.id 9 is not among cluster.nodes"},
      {"[cluster]\ndata_units = 4\n", "cluster.nodes"},
      {"[cluster]\ndata_units = 1\nparity_units = 1\n"
       "[[cluster.nodes]]\nid = 0\nhost = \"h\"\ncontrol_port = 1\ndata_port = 2\n",
       "1 nodes cannot form groups of k + m = 2"},
      {"[cluster]\ndata_units = 1\nparity_units = 1\n"
       "[[cluster.nodes]]\nid = 0\nhost = \"h\"\ncontrol_port = 1\ndata_port = 2\ncolour = 1\n",
       "cluster.nodes[0].colour: unknown key"},
      {"[cluster]\ndata_units = 1\nparity_units = 1\n"
       "[[cluster.nodes]]\nid = 0\nhost = \"h\"\ncontrol_port = 70000\ndata_port = 2\n",
       "cluster.nodes[0].control_port"},
      {"[cluster]\ndata_units = 1\nparity_units = 1\n"
       "[[cluster.nodes]]\nid = 0\nhost = \"h\"\ncontrol_port = 1\ndata_port = 2\n"
       "[[cluster.nodes]]\nid = 0\nhost = \"g\"\ncontrol_port = 1\ndata_port = 2\n",
       "node id 0 appears twice"},
      {"[cluster]\ndata_units = 1\nparity_units = 1\n"
       "[[cluster.nodes]]\nid = 0\nhost = \"h\"\ncontrol_port = 1\ndata_port = 2\n"
       "[[cluster.nodes]]\nid = 1\nhost = \"h\"\ncontrol_port = 2\ndata_port = 3\n",
       "h:2 is used twice"},
      {"[cluster]\nstripe_unit_bytes = 100\n[[cluster.nodes]]\nid = 0\nhost = \"h\"\n"
       "control_port = 1\ndata_port = 2\n",
       "multiple of 64"},
      {"[cluster]\nallow_degraded = \"yes\"\n", "cluster.allow_degraded"},
      {"[cluster]\nk = 4\n[[cluster.nodes]]\nid = 0\nhost = \"h\"\ncontrol_port = 1\ndata_port = 2\n"
       "[[cluster.nodes]]\nid = 1\nhost = \"h\"\ncontrol_port = 3\ndata_port = 4\n"
       "[[cluster.nodes]]\nid = 2\nhost = \"h\"\ncontrol_port = 5\ndata_port = 6\n"
       "[[cluster.nodes]]\nid = 3\nhost = \"h\"\ncontrol_port = 7\ndata_port = 8\n"
       "[[cluster.nodes]]\nid = 4\nhost = \"h\"\ncontrol_port = 9\ndata_port = 10\n"
       "[[cluster.nodes]]\nid = 5\nhost = \"h\"\ncontrol_port = 11\ndata_port = 12\n",
       "unknown key cluster.k"},
  };
  for (const auto& [text, mentions] : cases) {
    absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(text, "bad.toml");
    ASSERT_STATUS(options, absl::StatusCode::kInvalidArgument) << text;
    EXPECT_TRUE(absl::StrContains(options.status().message(), mentions))
        << options.status() << "\nshould mention: " << mentions;
    EXPECT_TRUE(absl::StrContains(options.status().message(), "bad.toml")) << options.status();
  }
}

}  // namespace
}  // namespace moesnap::daemon
