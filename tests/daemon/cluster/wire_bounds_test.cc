// Offsets and lengths from the data plane are checked without overflow before any byte lands:
// a frame whose offset wraps past 2^64 once passed `offset + length > bytes` and was written before
// the buffer (a fetched unit) or before the parity unit in the pool. On an authenticated connection
// a node sends only its own units: a parity delta of another node's data unit, or a fetched unit
// the receiver asked of another node, is refused. A fetched frame read into its slot that fails its
// check there fails the fetch; frames overlapping in a slot are refused; a fetch given up on waits
// for a frame still being read into its buffer. Pieces sent without a copy are cut into frames of at most the data
// plane's payload, each at its offset. A delta goes only with the committed bytes of every region
// it reads.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/step_changes.h"
#include "erasure/crc32c.h"
#include "tests/daemon/cluster/in_process_cluster.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

using testing::InProcessCluster;

constexpr uint64_t kWrapping = std::numeric_limits<uint64_t>::max() - 63;
constexpr uint8_t kCanary = 0x11;

// What the data plane does with a fetched frame that passes its checks: reads its payload into the
// memory the transfer reserves for it, then reports it filled.
absl::Status Deliver(Transfer& transfer, FrameHeader header, absl::Span<const uint8_t> payload,
                     std::optional<uint32_t> sender) {
  header.length = static_cast<uint32_t>(payload.size());
  absl::StatusOr<std::optional<FrameSink::InPlace>> into = transfer.Reserve(header, sender);
  if (!into.ok()) return into.status();
  if (!*into || (*into)->bytes.size() != payload.size()) {
    return absl::InternalError("a fetched frame was not given memory of its length");
  }
  std::copy(payload.begin(), payload.end(), (*into)->bytes.begin());
  transfer.Filled(header, absl::OkStatus());
  return absl::OkStatus();
}

TEST(WireBoundsTest, AFetchedUnitNeverLandsOutsideItsBuffer) {
  InProcessCluster cluster(3, 2, 1);
  Transfer& transfer = cluster.node(0).transfer;
  // 4096 bytes asked for, between 64-byte canaries on either side.
  std::vector<uint8_t> memory(64 + 4096 + 64, kCanary);
  const FetchKey key{1, 0, 0, 0, ""};
  ASSERT_OK(transfer.Expect({{key, {memory.data() + 64, 4096}}}));
  const std::vector<uint8_t> payload(64, 0xee);
  FrameHeader header;
  header.kind = FrameKind::kFetchedUnit;
  header.step = 1;
  header.length = static_cast<uint32_t>(payload.size());
  for (uint64_t offset : {kWrapping, uint64_t{4096 - 32}, uint64_t{4097}}) {
    header.offset = offset;
    const absl::Status status = Deliver(transfer, header, payload, std::nullopt);
    EXPECT_STATUS(status, absl::StatusCode::kInvalidArgument) << "offset " << offset;
    EXPECT_TRUE(absl::StrContains(status.message(), "more bytes than asked for")) << status;
  }
  for (size_t i = 0; i < memory.size(); ++i) ASSERT_EQ(memory[i], kCanary) << "byte " << i;
  const std::vector<uint8_t> whole(4096, 0x42);
  header.offset = 0;
  ASSERT_OK(Deliver(transfer, header, whole, std::nullopt));
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

TEST(WireBoundsTest, AnAuthenticatedNodeSendsOnlyUnitsItWasAskedFor) {
  InProcessCluster cluster(3, 2, 1);
  Transfer& transfer = cluster.node(0).transfer;
  std::vector<uint8_t> memory(4096, kCanary);
  const FetchKey key{1, 0, 0, 2, ""};
  ASSERT_OK(transfer.Expect({{key, {memory.data(), 4096, /*source=*/2}}}));
  const std::vector<uint8_t> whole(4096, 0x42);
  FrameHeader header;
  header.kind = FrameKind::kFetchedUnit;
  header.step = 1;
  header.rank = 2;  // a frame names its sender; node 1 claims to be node 2
  header.length = static_cast<uint32_t>(whole.size());
  const absl::Status forged = Deliver(transfer, header, whole, 1u);
  EXPECT_STATUS(forged, absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(forged.message(), "came from node 1, not from node 2")) << forged;
  EXPECT_EQ(memory, std::vector<uint8_t>(4096, kCanary));
  ASSERT_OK(Deliver(transfer, header, whole, 2u));
  EXPECT_OK(transfer.Collect({key}, absl::OkStatus()));
  EXPECT_EQ(memory, whole);
}

// Node 0 of a (2,1) cluster awaiting a 4096-byte unit (stripe 0 of step 1) from node 2, between
// canaries, and the header of the unit's frames.
class WireBoundsSlotTest : public ::testing::Test {
 protected:
  WireBoundsSlotTest() : cluster_(3, 2, 1), transfer_(cluster_.node(0).transfer) {
    header_.kind = FrameKind::kFetchedUnit;
    header_.step = 1;
    header_.rank = 2;
  }
  void SetUp() override {
    ASSERT_OK(transfer_.Expect({{key_, {memory_.data() + 64, 4096, /*source=*/2}}}));
  }
  uint8_t* unit() { return memory_.data() + 64; }

  InProcessCluster cluster_;
  Transfer& transfer_;
  std::vector<uint8_t> memory_ = std::vector<uint8_t>(64 + 4096 + 64, kCanary);
  const FetchKey key_{1, 0, 0, 2, ""};
  FrameHeader header_;
};

// A fetched frame is read straight into its slot and checked there. While one is read in, its
// bytes count as arrived: a frame wanting more than the rest is refused. One that fails its check
// fails the whole fetch, naming the unit and why, and the slot takes no more frames.
TEST_F(WireBoundsSlotTest, AFrameThatFailsItsCheckInItsSlotFailsTheFetch) {
  header_.length = 4096;
  absl::StatusOr<std::optional<FrameSink::InPlace>> into = transfer_.Reserve(header_, 2u);
  ASSERT_OK(into);
  ASSERT_TRUE(into->has_value());
  EXPECT_EQ((*into)->bytes.data(), unit());
  EXPECT_EQ((*into)->bytes.size(), 4096u);
  EXPECT_FALSE((*into)->owner_checks);  // a unit for a decode is checked as it lands
  FrameHeader more = header_;
  more.offset = 4000;
  more.length = 16;
  EXPECT_STATUS(transfer_.Reserve(more, 2u), absl::StatusCode::kInvalidArgument);
  transfer_.Filled(header_, absl::DataLossError("payload CRC-32C is 0badf00d"));
  EXPECT_STATUS(transfer_.Reserve(more, 2u), absl::StatusCode::kFailedPrecondition);
  const absl::Status collected = transfer_.Collect({key_}, absl::OkStatus());
  EXPECT_STATUS(collected, absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(collected.message(), key_.Describe()) &&
              absl::StrContains(collected.message(), "0badf00d"))
      << collected;
  EXPECT_STATUS(transfer_.Reserve(header_, 2u), absl::StatusCode::kInvalidArgument);  // forgotten
}

// Frames of a slot may arrive in any order (a peer sends on several connections), but each byte
// once: a frame over bytes another frame brought is refused, even while bytes are still missing,
// since counting it would leave others unwritten.
TEST_F(WireBoundsSlotTest, FramesOverlappingEachOtherInASlotAreRefused) {
  const std::vector<uint8_t> back(2048, 0x22), front(2048, 0x11);
  header_.offset = 2048;
  ASSERT_OK(Deliver(transfer_, header_, back, 2u));
  header_.offset = 1024;
  const absl::Status overlapping = Deliver(transfer_, header_, front, 2u);
  EXPECT_STATUS(overlapping, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(overlapping.message(), "came in another frame already"))
      << overlapping;
  header_.offset = 0;
  ASSERT_OK(Deliver(transfer_, header_, front, 2u));
  EXPECT_OK(transfer_.Collect({key_}, absl::OkStatus()));
  EXPECT_TRUE(std::equal(front.begin(), front.end(), unit()));
  EXPECT_TRUE(std::equal(back.begin(), back.end(), unit() + 2048));
  EXPECT_EQ(memory_[63], kCanary);
  EXPECT_EQ(memory_[64 + 4096], kCanary);
}

// A fetch given up on (its senders failed, or it timed out) does not return while a frame is still
// being read into its buffer, which its caller frees once it returns; meanwhile the slot takes no
// new frame.
TEST_F(WireBoundsSlotTest, ACollectedFetchWaitsForAFrameStillBeingReadIntoItsBuffer) {
  header_.length = 2048;
  ASSERT_OK(transfer_.Reserve(header_, 2u));
  std::atomic<bool> returned{false};
  absl::Status collected;
  std::thread collector([&] {
    collected = transfer_.Collect({key_}, absl::UnavailableError("the sender failed"));
    returned = true;
  });
  // A frame over the bytes being read in is refused as taken while the slot is open, as no longer
  // awaited once the collector has closed it, and as never asked for once it is forgotten.
  FrameHeader late = header_;
  late.length = 16;
  absl::Status refused;
  for (int attempt = 0; attempt < 2000; ++attempt) {
    refused = transfer_.Reserve(late, 2u).status();
    if (refused.ok() || absl::StrContains(refused.message(), "no longer awaited")) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(absl::StrContains(refused.message(), "no longer awaited")) << refused;
  EXPECT_FALSE(returned) << "Collect returned while a frame was being read into its buffer";
  transfer_.Filled(header_, absl::OkStatus());
  if (refused.ok()) transfer_.Filled(late, absl::OkStatus());
  collector.join();
  EXPECT_STATUS(collected, absl::StatusCode::kUnavailable);
}

// A unit sent from where its bytes lie (pieces of regions' pool memory, of any size, empty ones
// too) arrives whole, over frames that each gather the pieces they span.
TEST(WireBoundsTest, PiecesSentWithoutACopyArriveWholeAcrossFrames) {
  InProcessCluster cluster(3, 2, 1);
  constexpr uint64_t kMiB = 1 << 20;
  const std::vector<uint64_t> sizes = {3 * kMiB, 0, 5 * kMiB / 2, 9 * kMiB / 2 + 7, 1};
  std::vector<std::vector<uint8_t>> pieces;
  std::vector<uint8_t> whole;
  for (size_t i = 0; i < sizes.size(); ++i) {
    pieces.emplace_back(sizes[i]);
    for (uint64_t j = 0; j < sizes[i]; ++j) pieces.back()[j] = static_cast<uint8_t>(j * 7 + i);
    whole.insert(whole.end(), pieces.back().begin(), pieces.back().end());
  }
  std::vector<absl::Span<const uint8_t>> spans(pieces.begin(), pieces.end());
  std::vector<uint8_t> received(whole.size(), kCanary);
  const FetchKey key{1, 0, 0, 1, ""};
  ASSERT_OK(cluster.node(0).transfer.Expect(
      {{key, {received.data(), received.size(), /*source=*/1}}}));
  FrameHeader header;
  header.kind = FrameKind::kFetchedUnit;
  header.step = 1;
  header.rank = 1;
  ASSERT_OK(cluster.node(1).transfer.SendFrames(0, header, spans));
  ASSERT_OK(cluster.node(0).transfer.Collect({key}, absl::OkStatus()));
  EXPECT_TRUE(received == whole);

  // Pieces adding up to exactly two frames' payloads, and nothing at all.
  std::vector<uint8_t> exact(2 * Transfer::kFrameBytes);
  for (size_t i = 0; i < exact.size(); ++i) exact[i] = static_cast<uint8_t>(i * 31 + i / 4096);
  const std::vector<absl::Span<const uint8_t>> two_frames = {
      absl::Span<const uint8_t>(exact).first(Transfer::kFrameBytes / 4),
      absl::Span<const uint8_t>(exact).subspan(Transfer::kFrameBytes / 4)};
  std::vector<uint8_t> exact_received(exact.size(), kCanary);
  const FetchKey exact_key{1, 1, 0, 1, ""};
  ASSERT_OK(cluster.node(0).transfer.Expect(
      {{exact_key, {exact_received.data(), exact.size(), 1}}}));
  header.stripe = 1;
  ASSERT_OK(cluster.node(1).transfer.SendFrames(0, header, two_frames));
  ASSERT_OK(cluster.node(0).transfer.Collect({exact_key}, absl::OkStatus()));
  EXPECT_TRUE(exact_received == exact);
  EXPECT_OK(cluster.node(1).transfer.SendFrames(0, header, {}));
}

// Two decodes on one node wanting the same unit from the same node at once (helping a member of
// its group while repairing its own units): the second is refused whole, and the first still
// receives its unit.
TEST(WireBoundsTest, AUnitAwaitedAlreadyIsRefusedToASecondDecode) {
  InProcessCluster cluster(3, 2, 1);
  Transfer& transfer = cluster.node(0).transfer;
  std::vector<uint8_t> first(4096, kCanary), second(4096, kCanary), other(4096, kCanary);
  const FetchKey key{1, 0, 0, 2, ""};
  const FetchKey other_key{1, 1, 0, 2, ""};
  ASSERT_OK(transfer.Expect({{key, {first.data(), 4096, /*source=*/2}}}));
  const absl::Status refused = transfer.Expect(
      {{other_key, {other.data(), 4096, 2}}, {key, {second.data(), 4096, 2}}});
  EXPECT_STATUS(refused, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(refused.message(), "awaited by another decode")) << refused;
  const std::vector<uint8_t> whole(4096, 0x42);
  FrameHeader header;
  header.kind = FrameKind::kFetchedUnit;
  header.step = 1;
  header.rank = 2;
  header.length = static_cast<uint32_t>(whole.size());
  ASSERT_OK(Deliver(transfer, header, whole, 2u));
  EXPECT_OK(transfer.Collect({key}, absl::OkStatus()));
  EXPECT_EQ(first, whole);
  EXPECT_EQ(second, std::vector<uint8_t>(4096, kCanary));
  header.stripe = 1;  // the refused call registered none of its keys
  EXPECT_STATUS(Deliver(transfer, header, whole, 2u), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(other, std::vector<uint8_t>(4096, kCanary));
}

TEST(WireBoundsTest, AnAuthenticatedNodeSendsParityDeltasOfItsOwnUnitsOnly) {
  InProcessCluster cluster(3, 2, 1);
  const Topology& topology = *cluster.node(0).context.topology;
  const erasure::StripeMembers members = topology.layout.Members(0);
  const uint32_t holder = topology.NodeAt(members.parity_positions[0]);
  const uint32_t owner = topology.NodeAt(members.data_positions[0]);
  const uint32_t other = topology.NodeAt(members.data_positions[1]);
  const uint64_t unit = topology.layout.unit_bytes();
  ASSERT_OK(cluster.node(holder).parity.Begin(5, 1, {unit, unit, unit}, nullptr));
  const std::vector<uint8_t> payload(64, 0xee);
  FrameHeader header;
  header.kind = FrameKind::kParityDelta;
  header.step = 5;
  header.attempt = 1;
  header.length = static_cast<uint32_t>(payload.size());
  Transfer& transfer = cluster.node(holder).transfer;
  const absl::Status forged = transfer.Accept(header, payload, other);
  EXPECT_STATUS(forged, absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(forged.message(), absl::StrCat("node ", other, " sent a parity "
                                                               "delta of node ", owner)))
      << forged;
  header.stripe_unit = static_cast<uint32_t>(topology.layout.data_units());
  EXPECT_STATUS(transfer.Accept(header, payload, owner), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cluster.node(holder).parity.in_flight_bytes(), unit);
  header.stripe_unit = 0;
  EXPECT_OK(transfer.Accept(header, payload, owner));
}

// A delta XORs the new bytes of a changed unit with the committed ones of each region the unit
// holds: a node looks up only those regions (DeltaRegions), none of a unit that did not change or
// goes as itself in a fresh stripe, and a send whose committed bytes lack one is refused before a
// frame goes, where it would read memory that holds no region.
TEST(WireBoundsTest, ADeltaGoesOnlyWithTheCommittedBytesOfEveryRegionItReads) {
  InProcessCluster cluster(3, 2, 1);  // units of 64 KiB
  testing::NodeUnits& node = cluster.node(0);
  const erasure::StripeLayout& layout = node.context.layout();
  const int position = node.context.topology->position;
  constexpr uint64_t kKiB = 1024;
  // Units 0, 1 and 2 hold regions 0-1, 1-2 (2 ends there) and 3-4; region 4 is empty.
  v1::NodeImage manifest;
  for (uint64_t bytes : {40 * kKiB, 40 * kKiB, 48 * kKiB, 60 * kKiB, uint64_t{0}}) {
    v1::ImageRegion& region = *manifest.add_regions();
    region.set_region(absl::StrCat("r", manifest.regions_size() - 1));
    region.set_bytes(bytes);
  }
  manifest.set_bytes(188 * kKiB);
  absl::StatusOr<NodeImage> image = NodeImage::Allocate(node.pool.get(), manifest);
  ASSERT_OK(image);
  ASSERT_EQ(layout.UnitCount(image->bytes()), 3u);
  // The other members hold 16 units each, so that each of this node's units shares its stripe;
  // only this node's units at `changed` changed, or every member's every unit (each stripe afresh).
  std::vector<uint64_t> sizes(layout.group_size(), 16 * layout.unit_bytes());
  sizes[position] = image->bytes();
  auto changes_of = [&](const std::vector<bool>& changed, bool everyone) {
    std::vector<std::vector<bool>> units(layout.group_size(), std::vector<bool>(16, everyone));
    units[position] = changed;
    return ChangesOf(layout, std::move(units), sizes, {});
  };
  EXPECT_EQ(node.transfer.DeltaRegions(*image, changes_of({false, false, false}, false)),
            std::vector<int>{});
  EXPECT_EQ(node.transfer.DeltaRegions(*image, changes_of({true, false, false}, false)),
            (std::vector<int>{0, 1}));
  EXPECT_EQ(node.transfer.DeltaRegions(*image, changes_of({true, true, false}, false)),
            (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(node.transfer.DeltaRegions(*image, changes_of({false, false, true}, false)),
            (std::vector<int>{3}));
  EXPECT_EQ(node.transfer.DeltaRegions(*image, changes_of({true, true, true}, true)),
            std::vector<int>{});

  const StepChanges changes = changes_of({false, true, false}, false);
  std::vector<std::shared_ptr<PoolBytes>> committed(image->stored());
  committed[2] = nullptr;  // region 0's is not read: unit 0 did not change
  committed[0] = nullptr;
  const absl::Status refused =
      node.transfer.SendDataUnits(2, 1, *image, &committed, &changes, {}).status();
  EXPECT_STATUS(refused, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.message(), "region 2")) << refused;
  EXPECT_STATUS(node.transfer.SendDataUnits(2, 1, *image, &committed, nullptr, {}),
                absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moesnap::daemon::cluster
