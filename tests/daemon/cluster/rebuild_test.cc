// The rebuilder, in-process with real participants, coordinators, parity and data planes, and fakes
// at the store, peer-client, decision-log and election seams: a replacement rebuilds the latest
// committed step; a failed rebuild is reported, keeps Restore refused only while the node lacks
// its data, and is tried again until it works; an operator's failed rebuild of a node that holds
// its data leaves that data restorable; more than m lost names the group and the step.
#include "daemon/cluster/rebuild.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "erasure/crc32c.h"
#include "tests/daemon/cluster/in_process_cluster.h"
#include "tests/testing/damaging_proxy.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

using testing::InProcessCluster;

constexpr uint64_t kBytes = 300000;

// The CRC-32C of the bytes of each parity unit `node` holds, by stripe.
std::map<uint64_t, uint32_t> ParityCrcs(const testing::NodeUnits& node) {
  std::map<uint64_t, uint32_t> crcs;
  for (const ParityUnit& unit : node.parity.CommittedUnits()) {
    crcs[unit.stripe] = erasure::Crc32c(unit.extent->data(), unit.bytes);
  }
  return crcs;
}

void CommitSteps(InProcessCluster& cluster, int64_t last) {
  for (int64_t step = 1; step <= last; ++step) {
    cluster.CaptureEverywhere(step, kBytes);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
}

TEST(RebuildTest, AReplacementRebuildsTheLatestCommittedStepFromItsGroup) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  CommitSteps(cluster, 3);
  cluster.Replace(2);
  ASSERT_OK(cluster.node(2).rebuilder.WaitRestorable(absl::Now() + absl::Seconds(20)));
  EXPECT_EQ(cluster.node(2).participant.CommittedStep(), 3);
  EXPECT_TRUE(cluster.node(2).store.CommittedBytesOf() == testing::StateOf(2, 3, kBytes));
  // And it takes part again.
  cluster.CaptureEverywhere(4, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(4));
  cluster.ExpectEveryNodeRebuildable(4, kBytes);
}

// Repair at a helper: each stripe's unit is decoded by one of its sources, the sources taking
// turns, so the rebuilding node receives one unit per stripe it rebuilds (not k) and no one node
// decodes every stripe.
TEST(RebuildTest, TheRebuildingNodeReceivesOneUnitPerStripeFromHelpersTakingTurns) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  constexpr uint64_t kLarge = 4 << 20;  // many stripes
  for (int64_t step = 1; step <= 2; ++step) {
    cluster.CaptureEverywhere(step, kLarge);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  absl::Mutex mutex;
  std::map<uint32_t, int> decodes;  // by helper
  cluster.network().SetFilter([&](uint32_t from, uint32_t to, const std::string& call) {
    if (from == 1 && call == "DecodeUnits") {
      absl::MutexLock lock(&mutex);
      ++decodes[to];
    }
    return absl::OkStatus();
  });
  absl::StatusOr<v1::RebuildResponse> rebuilt = cluster.node(1).rebuilder.RebuildHere();
  ASSERT_OK(rebuilt);
  const uint64_t bytes = rebuilt->data_bytes() + rebuilt->parity_bytes();
  EXPECT_GT(rebuilt->stripes(), 8u);
  EXPECT_EQ(rebuilt->data_bytes(), kLarge);
  EXPECT_EQ(rebuilt->fetched_bytes(), bytes);
  // Each helper fetched the stripe's other k - 1 = 3 sources, less those virtually zero.
  EXPECT_GT(rebuilt->helper_fetched_bytes(), 2 * bytes);
  EXPECT_LE(rebuilt->helper_fetched_bytes(), 3 * bytes);
  EXPECT_GE(decodes.size(), 4u) << "the helpers did not take turns";
  EXPECT_TRUE(cluster.node(1).store.CommittedBytesOf() == testing::StateOf(1, 2, kLarge));
  cluster.ExpectEveryNodeRebuildable(2, kLarge);
}

// A rebuild receives each unit straight into its new image and parity where the unit lies in one
// piece of memory; a unit across two regions lands in scratch and is copied. Both come out exact.
TEST(RebuildTest, UnitsLandInTheNewImageInPlaceAndAUnitAcrossRegionsThroughScratch) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  constexpr uint64_t kUnit = InProcessCluster::kStripeUnitBytes;
  constexpr uint64_t kLarge = 16 * kUnit;
  constexpr uint64_t kKept = 2 * kUnit + kUnit / 2;  // unit 2 ends "kept" and starts "state"
  for (int64_t step = 1; step <= 2; ++step) {
    cluster.CaptureEverywhere(step, kLarge, kKept);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  const uint64_t before = cluster.node(1).rebuilder.in_place_bytes();
  absl::StatusOr<v1::RebuildResponse> rebuilt = cluster.node(1).rebuilder.RebuildHere();
  ASSERT_OK(rebuilt);
  EXPECT_EQ(rebuilt->data_bytes(), kLarge);
  EXPECT_EQ(rebuilt->fetched_bytes(), rebuilt->data_bytes() + rebuilt->parity_bytes());
  EXPECT_EQ(cluster.node(1).rebuilder.in_place_bytes() - before, rebuilt->fetched_bytes() - kUnit)
      << "every unit but the one across two regions lands in place";
  EXPECT_TRUE(cluster.node(1).store.CommittedBytesOf() == testing::StateOf(1, 2, kLarge, kKept));
  cluster.ExpectEveryNodeRebuildable(2, kLarge);
}

// Data received in place is checked once whole, against the chunk CRCs the trainer's capture
// recorded: survivors' damaged units fail the rebuild, naming a chunk, and the node keeps the data
// it held.
TEST(RebuildTest, SurvivorsDamagedUnitsFailTheRebuildNamingAChunk) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  CommitSteps(cluster, 2);
  // A byte of every data unit of every other node, at an offset of its own (damage at one offset
  // in every source could cancel out in a decode): each stripe decodes from damaged units.
  for (uint32_t node : {0u, 2u, 3u, 4u, 5u}) {
    for (uint64_t at = 7 + node; at < kBytes; at += InProcessCluster::kStripeUnitBytes) {
      cluster.node(node).store.FlipCommittedByte(at);
    }
  }
  const uint64_t before = cluster.node(1).rebuilder.in_place_bytes();
  const absl::StatusOr<v1::RebuildResponse> rebuilt = cluster.node(1).rebuilder.RebuildHere();
  ASSERT_STATUS(rebuilt.status(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(rebuilt.status().message(), "chunk CRCs (first: region 'state'"))
      << rebuilt.status();
  EXPECT_TRUE(absl::StrContains(rebuilt.status().message(), ", chunk ")) << rebuilt.status();
  EXPECT_GT(cluster.node(1).rebuilder.in_place_bytes(), before) << "no unit landed in place";
  EXPECT_OK(cluster.node(1).rebuilder.WaitRestorable(absl::Now()));
  EXPECT_TRUE(cluster.node(1).store.CommittedBytesOf() == testing::StateOf(1, 2, kBytes));
}

// A survivor's damaged parity fails the rebuild (DATA_LOSS naming the parity) wherever it is read:
// its holder checks it before sending any of it (in the pass that checksums its frames), a helper
// that holds it before decoding from it. The node keeps the data it held. Units of one frame and of
// several.
class DamagedParityTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(DamagedParityTest, FailsTheRebuildNamingTheParity) {
  const uint64_t unit_bytes = GetParam();
  InProcessCluster cluster(6, 4, 2, /*allow_degraded=*/false, unit_bytes);
  cluster.election().Elect(0);
  const uint64_t bytes = 3 * unit_bytes / 2;  // two stripes, parity of a whole unit in the first
  for (int64_t step = 1; step <= 2; ++step) {
    cluster.CaptureEverywhere(step, bytes);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  const erasure::StripeLayout& layout = cluster.node(0).context.layout();
  std::optional<std::pair<uint32_t, v1::UnitRef>> served;  // a damaged unit, its holder not node 1
  for (uint64_t stripe = 0; stripe < 2; ++stripe) {
    const std::vector<int>& holders = layout.Members(stripe).parity_positions;
    for (size_t j = 0; j < holders.size(); ++j) {
      const uint32_t node = cluster.node(0).context.topology->NodeAt(holders[j]);
      if (node == 1) continue;
      std::optional<ParityUnit> unit = cluster.node(node).parity.CommittedOf(2, stripe);
      ASSERT_TRUE(unit.has_value()) << "node " << node << ", stripe " << stripe;
      unit->extent->data()[unit->bytes - 1 - node] ^= 0x10;
      v1::UnitRef ref;
      ref.set_stripe(stripe);
      ref.set_unit(static_cast<uint32_t>(layout.data_units() + j));
      served = {node, ref};
    }
  }
  ASSERT_TRUE(served.has_value());

  const absl::StatusOr<v1::RebuildResponse> rebuilt = cluster.node(1).rebuilder.RebuildHere();
  ASSERT_STATUS(rebuilt.status(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(rebuilt.status().message(),
                                "fails its CRC-32C (moesnapctl verify --repair)"))
      << rebuilt.status();
  EXPECT_OK(cluster.node(1).rebuilder.WaitRestorable(absl::Now()));
  EXPECT_TRUE(cluster.node(1).store.CommittedBytesOf() == testing::StateOf(1, 2, bytes));

  // Its holder refuses to send it.
  v1::SendUnitsRequest request;
  request.set_to_node(1);
  request.set_step(2);
  request.set_request(cluster.node(1).transfer.NewRequest());
  *request.add_units() = served->second;
  const absl::StatusOr<v1::SendUnitsResponse> sent =
      cluster.node(served->first).transfer.ServeUnits(request);
  ASSERT_STATUS(sent.status(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(
      sent.status().message(), absl::StrCat("parity of stripe ", served->second.stripe())))
      << sent.status();

  // And decodes nothing from it: data unit 0 of its stripe from data units 1 to 3 and it.
  v1::DecodeUnitsRequest decode;
  decode.set_to_node(1);
  decode.set_step(2);
  decode.set_request(cluster.node(1).transfer.NewRequest());
  v1::DecodeStripe* stripe = decode.add_stripes();
  stripe->set_stripe(served->second.stripe());
  stripe->set_target(0);
  for (uint32_t source : {1u, 2u, 3u, served->second.unit()}) stripe->add_sources(source);
  const absl::StatusOr<v1::DecodeUnitsResponse> decoded =
      cluster.node(served->first).rebuilder.DecodeFor(decode, [] { return false; });
  ASSERT_STATUS(decoded.status(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(
      decoded.status().message(), absl::StrCat("parity of stripe ", served->second.stripe())))
      << decoded.status();
}

INSTANTIATE_TEST_SUITE_P(UnitSizes, DamagedParityTest,
                         ::testing::Values(InProcessCluster::kStripeUnitBytes,
                                           uint64_t{5} * Transfer::kFrameBytes / 2),
                         [](const ::testing::TestParamInfo<uint64_t>& param) {
                           return param.param <= Transfer::kFrameBytes ? "OneFrame"
                                                                       : "SeveralFrames";
                         });

// Each helper is sent its next request as soon as it has answered the last: one slow helper does
// not hold the others back (no rebuild-wide batches), and the bytes still come out exact.
TEST(RebuildTest, EachHelperIsSentItsNextRequestWhileAnotherIsStillDecoding) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  constexpr uint64_t kLarge = 4 << 20;  // many stripes: several requests to each helper
  for (int64_t step = 1; step <= 2; ++step) {
    cluster.CaptureEverywhere(step, kLarge);
    ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
  }
  absl::Mutex mutex;
  std::map<uint32_t, int> requests;  // by helper
  std::optional<uint32_t> slow;      // the helper whose first request is held
  bool overtaken = false;            // another helper got a second request meanwhile
  cluster.network().SetFilter([&](uint32_t from, uint32_t to, const std::string& call) {
    if (from != 1 || call != "DecodeUnits") return absl::OkStatus();
    absl::MutexLock lock(&mutex);
    ++requests[to];
    if (slow) return absl::OkStatus();
    slow = to;
    // Held until another helper has been sent its second request (a batched rebuild never does
    // while this one is held, and the wait ends without it).
    const auto another_asked_again = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex) {
      for (const auto& [node, count] : requests) {
        if (node != to && count >= 2) return true;
      }
      return false;
    };
    overtaken = mutex.AwaitWithTimeout(absl::Condition(&another_asked_again), absl::Seconds(20));
    return absl::OkStatus();
  });
  absl::StatusOr<v1::RebuildResponse> rebuilt = cluster.node(1).rebuilder.RebuildHere();
  ASSERT_OK(rebuilt);
  EXPECT_TRUE(overtaken) << "no helper was sent a second request while another decoded its first";
  EXPECT_GE(requests.size(), 4u);
  for (const auto& [node, count] : requests) {
    EXPECT_GE(count, 2) << "helper " << node << " had all its stripes in one request";
  }
  EXPECT_TRUE(cluster.node(1).store.CommittedBytesOf() == testing::StateOf(1, 2, kLarge));
  cluster.ExpectEveryNodeRebuildable(2, kLarge);
}

// A helper checks a decode request against the step it holds: hostile or stale requests are
// refused naming what is wrong, before anything is fetched or sent.
TEST(RebuildTest, AHelperRefusesDecodesThatDoNotFitTheStepItHolds) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  CommitSteps(cluster, 2);
  Rebuilder& helper = cluster.node(3).rebuilder;
  const std::function<bool()> never = [] { return false; };
  auto request = [](int64_t step, uint64_t stripe, uint32_t target, std::vector<uint32_t> sources) {
    v1::DecodeUnitsRequest decode_units;
    decode_units.set_to_node(1);
    decode_units.set_step(step);
    v1::DecodeStripe* decode = decode_units.add_stripes();
    decode->set_stripe(stripe);
    decode->set_target(target);
    for (uint32_t source : sources) decode->add_sources(source);
    return decode_units;
  };
  auto refused = [&](const v1::DecodeUnitsRequest& asked, absl::StatusCode code,
                     const std::string& words) {
    absl::StatusOr<v1::DecodeUnitsResponse> answer = helper.DecodeFor(asked, never);
    EXPECT_STATUS(answer, code);
    EXPECT_TRUE(absl::StrContains(answer.status().message(), words)) << answer.status();
  };
  refused(request(1, 0, 0, {1, 2, 3, 4}), absl::StatusCode::kFailedPrecondition,
          "does not hold step 1");
  refused(request(2, 1000000, 0, {1, 2, 3, 4}), absl::StatusCode::kInvalidArgument, "the step has");
  refused(request(2, 0, 0, {1, 2, 3}), absl::StatusCode::kInvalidArgument,
          "takes 4 distinct other units");
  refused(request(2, 0, 0, {0, 1, 2, 3}), absl::StatusCode::kInvalidArgument,
          "takes 4 distinct other units");
  refused(request(2, 0, 0, {1, 1, 2, 3}), absl::StatusCode::kInvalidArgument,
          "takes 4 distinct other units");
  v1::DecodeUnitsRequest twice = request(2, 0, 0, {1, 2, 3, 4});
  *twice.add_stripes() = twice.stripes(0);
  refused(twice, absl::StatusCode::kInvalidArgument, "asked for twice");
  v1::DecodeUnitsRequest too_much = request(2, 0, 0, {1, 2, 3, 4});
  for (uint64_t stripe : {1, 2}) {  // three stripes exceed the cluster's request bound
    *too_much.add_stripes() = too_much.stripes(0);
    too_much.mutable_stripes()->rbegin()->set_stripe(stripe);
  }
  refused(too_much, absl::StatusCode::kInvalidArgument, "bytes to decode at once");
  EXPECT_STATUS(helper.DecodeFor(request(2, 0, 0, {1, 2, 3, 4}), [] { return true; }),
                absl::StatusCode::kCancelled);
  // A good request is served: node 1 receives the unit its owner holds.
  const erasure::StripeLayout& layout = cluster.node(1).context.layout();
  const int position = layout.Members(0).data_positions[0];
  const uint64_t bytes = layout.UnitLength(kBytes, layout.DataUnitOf(position, 0));
  // Its frames carry the request's token: the receiver awaits them under it.
  Transfer& receiver = cluster.node(1).transfer;
  v1::DecodeUnitsRequest good = request(2, 0, 0, {1, 2, 3, 4});
  good.set_request(receiver.NewRequest());
  const FetchKey from_helper{2, 0, 0, 3, "", good.request()};
  std::vector<uint8_t> decoded(bytes), held(bytes);
  ASSERT_OK(receiver.Expect({{from_helper, {decoded.data(), bytes, 3}}}));
  absl::StatusOr<v1::DecodeUnitsResponse> served = helper.DecodeFor(good, never);
  ASSERT_OK(receiver.Collect({from_helper}, served.status()));
  EXPECT_EQ(served->sent_bytes(), bytes);
  const uint32_t owner = cluster.node(1).context.topology->NodeAt(0, position);
  v1::SendUnitsRequest send;
  send.set_to_node(1);
  send.set_step(2);
  send.set_request(receiver.NewRequest());
  send.add_units()->set_stripe(0);
  const FetchKey from_owner{2, 0, 0, owner, "", send.request()};
  ASSERT_OK(receiver.Expect({{from_owner, {held.data(), bytes, owner}}}));
  ASSERT_OK(receiver.Collect({from_owner}, cluster.node(owner).transfer.ServeUnits(send).status()));
  EXPECT_TRUE(decoded == held) << "the helper decoded another unit than its owner holds";
}

// A unit's frames carry the token of the request they answer. Those of a request given up on (a
// failed rebuild attempt's, still in flight when the next begins) are read and dropped: they
// neither land in the next attempt's slot for the same unit nor close the connection, which would
// lose the frames behind them. A token this node never issued still closes it.
TEST(RebuildTest, AUnitAnsweringARequestGivenUpOnIsDroppedAndLandsNowhere) {
  InProcessCluster cluster(3, 2, 1);
  Transfer& transfer = cluster.node(0).transfer;
  const int64_t given_up = transfer.NewRequest();
  std::vector<uint8_t> first(4096), second(4096);
  const FetchKey old_key{1, 0, 0, 1, "", given_up};
  ASSERT_OK(transfer.Expect({{old_key, {first.data(), first.size(), 1}}}));
  EXPECT_STATUS(transfer.Collect({old_key}, absl::CancelledError("the attempt failed")),
                absl::StatusCode::kCancelled);
  const int64_t again = transfer.NewRequest();
  const FetchKey new_key{1, 0, 0, 1, "", again};
  ASSERT_OK(transfer.Expect({{new_key, {second.data(), second.size(), 1}}}));

  FrameHeader late;
  late.kind = FrameKind::kFetchedUnit;
  late.step = 1;
  late.rank = 1;
  late.length = 4096;
  late.attempt = given_up;
  absl::StatusOr<std::optional<FrameSink::InPlace>> into = transfer.Reserve(late, 1);
  ASSERT_OK(into);
  ASSERT_TRUE(into->has_value());
  EXPECT_TRUE((*into)->drop) << "a late unit was given the next attempt's memory";
  FrameHeader never = late;
  never.attempt = again + 1000;
  EXPECT_STATUS(transfer.Reserve(never, 1).status(), absl::StatusCode::kInvalidArgument);

  FrameHeader current = late;
  current.attempt = again;
  into = transfer.Reserve(current, 1);
  ASSERT_OK(into);
  ASSERT_TRUE(into->has_value());
  EXPECT_EQ((*into)->bytes.data(), second.data());
  std::fill(second.begin(), second.end(), 0x5a);
  transfer.Filled(current, absl::OkStatus());
  EXPECT_OK(transfer.Collect({new_key}, absl::OkStatus()));
}

// A frame to a replacement damaged on the wire (a byte inverted: in a frame's header, or in a
// payload) fails its checksum: a header's or parity's as it lands, closing the connection it came
// on with the frames behind it; data's in the whole new image before it is installed. No damaged
// byte is installed; the rebuild fails at once, not after waiting for the lost frames, and is
// tried again; the node ends with its data and parity exact.
TEST(RebuildTest, AFrameDamagedOnTheWireToARebuildingNodeFailsTheAttemptAtOnce) {
  constexpr uint64_t kLarge = 4 << 20;  // units of 64 KiB: a byte 200,000 into a stream is a payload's
  for (const uint64_t at : {uint64_t{10}, uint64_t{200000}}) {
    SCOPED_TRACE(absl::StrCat("byte ", at, " of a connection inverted"));
    InProcessCluster cluster(6, 4, 2);
    cluster.election().Elect(0);
    for (int64_t step = 1; step <= 2; ++step) {
      cluster.CaptureEverywhere(step, kLarge);
      ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
    }
    const std::map<uint64_t, uint32_t> parity = ParityCrcs(cluster.node(2));
    ASSERT_FALSE(parity.empty());
    std::unique_ptr<moesnap::testing::DamagingProxy> wire;
    cluster.Replace(2, [&](uint16_t port) {
      wire = std::make_unique<moesnap::testing::DamagingProxy>(port, at, 1);
      return wire->port();
    });
    const absl::Time start = absl::Now();
    bool chunk_crcs_failed = false;
    absl::Status restorable;
    while (absl::Now() - start < Transfer::kFetchWait) {
      restorable = cluster.node(2).rebuilder.WaitRestorable(absl::Now() + absl::Milliseconds(50));
      if (restorable.ok()) break;
      chunk_crcs_failed = chunk_crcs_failed || absl::StrContains(restorable.message(), "chunk CRCs");
      // The last attempt's failure stays reported until one succeeds.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_OK(restorable) << "the rebuild waited for frames lost with the damaged one";
    EXPECT_EQ(wire->damaged(), 1);
    // Caught by a frame's own checksums (the connection closed), or, in data landing in place, by
    // the new image's chunk CRCs.
    EXPECT_TRUE(cluster.node(2).transfer.ConnectionsClosed().first > 0 || chunk_crcs_failed)
        << "nothing caught the damaged frame";
    EXPECT_EQ(cluster.node(2).participant.CommittedStep(), 2);
    EXPECT_TRUE(cluster.node(2).store.CommittedBytesOf() == testing::StateOf(2, 2, kLarge));
    EXPECT_EQ(ParityCrcs(cluster.node(2)), parity) << "the rebuilt parity differs from the lost";
    cluster.ExpectEveryNodeRebuildable(2, kLarge);
  }
}

// The fourth failure, first half: a failed rebuild used to be final until a restart.
TEST(RebuildTest, AFailedRebuildIsReportedAndTriedAgainUntilItWorks) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  CommitSteps(cluster, 2);
  // Exactly three of its helpers' decodes are refused. The rebuild asks several helpers at once,
  // so the count is compared and raised in one atomic step.
  std::atomic<int> refused{0};
  cluster.network().SetFilter([&](uint32_t from, uint32_t, const std::string& call) {
    if (from != 2 || call != "DecodeUnits") return absl::OkStatus();
    for (int seen = refused.load(); seen < 3;) {
      if (refused.compare_exchange_weak(seen, seen + 1)) {
        return absl::UnavailableError("a survivor restarted");
      }
    }
    return absl::OkStatus();
  });
  cluster.Replace(2);
  bool reported = false;
  absl::Status restorable;
  for (int attempt = 0; attempt < 400; ++attempt) {
    restorable = cluster.node(2).rebuilder.WaitRestorable(absl::Now() + absl::Milliseconds(50));
    if (restorable.ok()) break;
    reported = reported || absl::StrContains(restorable.message(), "a survivor restarted");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_OK(restorable);
  EXPECT_TRUE(reported) << "the failed attempts were not reported to Restore";
  EXPECT_EQ(refused, 3);
  EXPECT_TRUE(cluster.node(2).store.CommittedBytesOf() == testing::StateOf(2, 2, kBytes));
}

// The fourth failure, second half: a failed rebuild of a node whose data is intact used to
// refuse Restore of that data until the daemon restarted.
TEST(RebuildTest, AFailedRebuildOfANodeThatHoldsItsDataLeavesItRestorableAndInTheCluster) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  CommitSteps(cluster, 2);
  cluster.network().SetFilter([](uint32_t from, uint32_t, const std::string& call) {
    if (from == 1 && call == "DecodeUnits")
      return absl::DataLossError("a survivor's units are corrupt");
    return absl::OkStatus();
  });
  EXPECT_STATUS(cluster.node(1).rebuilder.RebuildHere(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(cluster.node(1).rebuilder.last_failure().message(), "corrupt"));
  EXPECT_OK(cluster.node(1).rebuilder.WaitRestorable(absl::Now()));
  EXPECT_TRUE(cluster.node(1).store.CommittedBytesOf() == testing::StateOf(1, 2, kBytes));
  cluster.network().SetFilter(nullptr);
  cluster.CaptureEverywhere(3, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(3));
}

TEST(RebuildTest, MoreThanMLostNamesTheGroupAndTheStepAndIsTriedAgain) {
  InProcessCluster cluster(6, 4, 2);
  cluster.election().Elect(0);
  CommitSteps(cluster, 2);
  cluster.network().Cut(3);
  cluster.network().Cut(4);
  cluster.Replace(0);
  absl::Status restorable = cluster.node(0).rebuilder.WaitRestorable(absl::Now() + absl::Seconds(20));
  ASSERT_STATUS(restorable, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(restorable.message(), "group 0 [0, 1, 2, 3, 4, 5] has lost nodes"))
      << restorable;
  EXPECT_TRUE(absl::StrContains(restorable.message(), "step 2 of node 0 can no longer be recovered"))
      << restorable;
  // A survivor that comes back makes the next attempt succeed.
  cluster.network().Heal(3);
  for (int attempt = 0; attempt < 400 && !restorable.ok(); ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    restorable = cluster.node(0).rebuilder.WaitRestorable(absl::Now());
  }
  ASSERT_OK(restorable);
  EXPECT_TRUE(cluster.node(0).store.CommittedBytesOf() == testing::StateOf(0, 2, kBytes));
}

}  // namespace
}  // namespace moesnap::daemon::cluster
