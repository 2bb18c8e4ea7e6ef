// Offsets and lengths from the data plane are checked without overflow before any byte lands:
// a frame whose offset wraps past 2^64 once passed `offset + length > bytes` and was written before
// the buffer (a fetched unit) or before the parity unit in the pool.
#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "absl/strings/match.h"
#include "erasure/crc32c.h"
#include "tests/daemon/cluster/in_process_cluster.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

using testing::InProcessCluster;

constexpr uint64_t kWrapping = std::numeric_limits<uint64_t>::max() - 63;
constexpr uint8_t kCanary = 0x11;

TEST(WireBoundsTest, AFetchedUnitNeverLandsOutsideItsBuffer) {
  InProcessCluster cluster(3, 2, 1);
  Transfer& transfer = cluster.node(0).transfer;
  // 4096 bytes asked for, between 64-byte canaries on either side.
  std::vector<uint8_t> memory(64 + 4096 + 64, kCanary);
  const FetchKey key{1, 0, 0, 0, ""};
  transfer.Expect({{key, {memory.data() + 64, 4096, 4096}}});
  const std::vector<uint8_t> payload(64, 0xee);
  FrameHeader header;
  header.kind = FrameKind::kFetchedUnit;
  header.step = 1;
  header.length = static_cast<uint32_t>(payload.size());
  for (uint64_t offset : {kWrapping, uint64_t{4096 - 32}, uint64_t{4097}}) {
    header.offset = offset;
    const absl::Status status = transfer.Accept(header, payload);
    EXPECT_STATUS(status, absl::StatusCode::kInvalidArgument) << "offset " << offset;
    EXPECT_TRUE(absl::StrContains(status.message(), "more bytes than asked for")) << status;
  }
  for (size_t i = 0; i < memory.size(); ++i) ASSERT_EQ(memory[i], kCanary) << "byte " << i;
  const std::vector<uint8_t> whole(4096, 0x42);
  header.offset = 0;
  ASSERT_OK(transfer.Accept(header, whole));
  EXPECT_OK(transfer.Collect({key}, absl::OkStatus()));
  EXPECT_EQ(memory[63], kCanary);
  EXPECT_EQ(memory[64 + 4096], kCanary);
}

TEST(WireBoundsTest, AParityDeltaNeverLandsOutsideItsUnit) {
  InProcessCluster cluster(3, 2, 1);
  const Topology& topology = *cluster.node(0).context.topology;
  const int holder = topology.layout.Members(0).parity_positions[0];
  ParityStore& parity = cluster.node(topology.NodeAt(holder)).parity;
  const uint64_t unit = topology.layout.unit_bytes();
  ASSERT_OK(parity.Begin(5, 1, {unit, unit, unit}, nullptr));
  const std::vector<uint8_t> payload(64, 0xee);
  FrameHeader header;
  header.kind = FrameKind::kParityDelta;
  header.step = 5;
  header.attempt = 1;
  header.stripe = 0;
  header.length = static_cast<uint32_t>(payload.size());
  for (uint64_t offset : {kWrapping, unit - 32, unit + 1}) {
    header.offset = offset;
    const absl::Status status = parity.Accept(header, payload);
    EXPECT_STATUS(status, absl::StatusCode::kInvalidArgument) << "offset " << offset;
    EXPECT_TRUE(absl::StrContains(status.message(), "do not fit a unit")) << status;
  }
  header.offset = 0;
  header.stripe_unit = static_cast<uint32_t>(topology.layout.data_units());
  EXPECT_STATUS(parity.Accept(header, payload), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(parity.in_flight_bytes(), unit);
}

}  // namespace
}  // namespace moesnap::daemon::cluster
