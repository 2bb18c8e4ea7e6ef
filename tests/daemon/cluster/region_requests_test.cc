// An elastic restore asks the holder of a committed region for it on the data plane: the holder
// sends its chunks back, or refuses with its reason, which fails the fetch at once; a fetch from a
// node lost before it sent fails without waiting out the fetch's timeout. On an authenticated
// connection a node asks only for itself, and only the node asked refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/daemon/cluster/in_process_cluster.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

using testing::InProcessCluster;
using testing::NodeUnits;

constexpr uint64_t kBytes = (3 << 20) + 12345;  // chunks of several frames, the last shorter

void CommitStep(InProcessCluster& cluster, int64_t step) {
  cluster.CaptureEverywhere(step, kBytes);
  ASSERT_TRUE(cluster.WaitCommitted(step)) << "step " << step;
}

FetchKey RegionKey(int64_t step, uint32_t rank, const std::string& region, int64_t request) {
  return {step, 0, 0, rank, region, request};
}

// A frame of `kind` about rank 1's region "state" of step 1, naming request `token`.
FrameHeader StateFrame(FrameKind kind, int64_t token) {
  FrameHeader header;
  header.kind = kind;
  header.step = 1;
  header.rank = 1;
  header.region = "state";
  header.attempt = token;
  return header;
}

// Expects region `key` from node `holder` into `into`, checked by its owner (as a restore does).
absl::Status ExpectRegion(Transfer& transfer, const FetchKey& key, uint32_t holder,
                          std::vector<uint8_t>& into) {
  return transfer.Expect({{key, {.buffer = into.data(),
                                 .bytes = into.size(),
                                 .source = holder,
                                 .owner_checks = true}}});
}

// Node 0 fetches rank `rank`'s region `region` of `step` from node `holder` into `into`.
absl::Status Fetch(InProcessCluster& cluster, uint32_t holder, int64_t step, uint32_t rank,
                   const std::string& region, std::vector<uint8_t>& into) {
  Transfer& transfer = cluster.node(0).transfer;
  const int64_t request = transfer.NewRequest();
  const FetchKey key = RegionKey(step, rank, region, request);
  if (absl::Status expected = ExpectRegion(transfer, key, holder, into); !expected.ok()) {
    return expected;
  }
  return transfer.Collect({key}, transfer.RequestRegions(holder, step, rank, {region}, request));
}

TEST(RegionRequestsTest, AHeldRegionIsSentBackWhenAskedOnTheDataPlane) {
  InProcessCluster cluster(3, 2, 1);
  cluster.election().Elect(0);
  ASSERT_NO_FATAL_FAILURE(CommitStep(cluster, 1));
  std::vector<uint8_t> fetched(kBytes);
  ASSERT_OK(Fetch(cluster, 1, 1, 1, "state", fetched));
  EXPECT_TRUE(fetched == testing::StateOf(1, 1, kBytes));
  // Asked again, after the step moved on: the new step's bytes.
  ASSERT_NO_FATAL_FAILURE(CommitStep(cluster, 2));
  ASSERT_OK(Fetch(cluster, 2, 2, 2, "state", fetched));
  EXPECT_TRUE(fetched == testing::StateOf(2, 2, kBytes));
}

TEST(RegionRequestsTest, ARegionTheHolderCannotSendFailsTheFetchWithItsReason) {
  InProcessCluster cluster(3, 2, 1);
  cluster.election().Elect(0);
  ASSERT_NO_FATAL_FAILURE(CommitStep(cluster, 1));
  std::vector<uint8_t> fetched(kBytes);
  const absl::Status missing = Fetch(cluster, 1, 1, 1, "missing", fetched);
  EXPECT_STATUS(missing, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(missing.message(),
                                "node 1 refused it: node 1 holds no region 'missing' of rank 1"))
      << missing;
  const absl::Status past = Fetch(cluster, 1, 7, 1, "state", fetched);
  EXPECT_STATUS(past, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(past.message(), "node 1 does not hold step 7")) << past;
  // The refused fetches are forgotten: the same keys can be asked for again.
  ASSERT_OK(Fetch(cluster, 1, 1, 1, "state", fetched));
  EXPECT_TRUE(fetched == testing::StateOf(1, 1, kBytes));
}

// One request names several regions: the holder answers each, a region it cannot send with its
// refusal and the others with their bytes, whichever comes first.
TEST(RegionRequestsTest, ARequestNamingSeveralRegionsIsAnsweredRegionByRegion) {
  InProcessCluster cluster(3, 2, 1);
  cluster.election().Elect(0);
  constexpr int kRegions = 4;  // of 789,519 bytes: one fits a request's bound
  cluster.node(1).store.SplitState(kRegions);
  ASSERT_NO_FATAL_FAILURE(CommitStep(cluster, 1));
  const uint64_t each = (kBytes + kRegions - 1) / kRegions;
  const std::vector<uint8_t> whole = testing::StateOf(1, 1, kBytes);
  const std::vector<uint8_t> expected(whole.begin() + each, whole.begin() + 2 * each);
  Transfer& transfer = cluster.node(0).transfer;
  for (const std::vector<absl::string_view>& names :
       {std::vector<absl::string_view>{"missing", "state.1"}, {"state.1", "missing"}}) {
    const int64_t request = transfer.NewRequest();
    std::vector<uint8_t> state(each);
    std::vector<uint8_t> missing(4096);
    const FetchKey state_key = RegionKey(1, 1, "state.1", request);
    const FetchKey missing_key = RegionKey(1, 1, "missing", request);
    ASSERT_OK(ExpectRegion(transfer, state_key, 1, state));
    ASSERT_OK(ExpectRegion(transfer, missing_key, 1, missing));
    const absl::Status asked = transfer.RequestRegions(1, 1, 1, names, request);
    ASSERT_OK(transfer.Collect({state_key}, asked)) << names[0] << " first";
    EXPECT_TRUE(state == expected) << names[0] << " first";
    const absl::Status refused = transfer.Collect({missing_key}, asked);
    EXPECT_STATUS(refused, absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(refused.message(), "node 1 holds no region 'missing' of rank 1"))
        << refused;
  }
}

// Collect waits for the last key first, yet a refusal of an earlier one ends the wait at once: here
// the last key is never asked for, so only the refusal can end it before the fetch's timeout.
TEST(RegionRequestsTest, ARefusalOfAnEarlierRegionEndsTheWaitForTheLast) {
  InProcessCluster cluster(3, 2, 1);
  cluster.election().Elect(0);
  ASSERT_NO_FATAL_FAILURE(CommitStep(cluster, 1));
  Transfer& transfer = cluster.node(0).transfer;
  const int64_t request = transfer.NewRequest();
  std::vector<uint8_t> missing(4096), never(4096);
  const FetchKey missing_key = RegionKey(1, 1, "missing", request);
  const FetchKey never_key = RegionKey(1, 1, "never", request);
  ASSERT_OK(ExpectRegion(transfer, missing_key, 1, missing));
  ASSERT_OK(ExpectRegion(transfer, never_key, 1, never));
  const absl::Time start = absl::Now();
  const absl::Status collected = transfer.Collect(
      {missing_key, never_key}, transfer.RequestRegions(1, 1, 1, {"missing"}, request));
  EXPECT_STATUS(collected, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(collected.message(), "holds no region 'missing'")) << collected;
  EXPECT_LT(absl::Now() - start, Transfer::kFetchWait);
}

// A request names 1 to RegionRequest::kMaxRegions distinct regions; the asking node refuses to
// send another.
TEST(RegionRequestsTest, ARequestOutsideItsBoundsIsNotSent) {
  InProcessCluster cluster(3, 2, 1);
  Transfer& transfer = cluster.node(0).transfer;
  EXPECT_STATUS(transfer.RequestRegions(1, 1, 1, {}, transfer.NewRequest()),
                absl::StatusCode::kInvalidArgument);
  const std::vector<absl::string_view> too_many(RegionRequest::kMaxRegions + 1, "state");
  EXPECT_STATUS(transfer.RequestRegions(1, 1, 1, too_many, transfer.NewRequest()),
                absl::StatusCode::kInvalidArgument);
}

// The regions of a request naming several hold at most RegionRequest::kMaxBytes together: the
// holder sends those within the bound, in the order named, and refuses the rest. A region larger
// than the bound comes when a request names it alone.
TEST(RegionRequestsTest, RegionsPastARequestsByteBoundAreRefused) {
  InProcessCluster cluster(3, 2, 1);
  cluster.election().Elect(0);
  constexpr int kRegions = 8;  // of 394,760 bytes: two fit in 1 MiB, three do not
  cluster.node(1).store.SplitState(kRegions);
  ASSERT_NO_FATAL_FAILURE(CommitStep(cluster, 1));
  const uint64_t each = (kBytes + kRegions - 1) / kRegions;
  ASSERT_LE(2 * each, RegionRequest::kMaxBytes);
  ASSERT_GT(3 * each, RegionRequest::kMaxBytes);
  const std::vector<uint8_t> state = testing::StateOf(1, 1, kBytes);
  Transfer& transfer = cluster.node(0).transfer;
  const int64_t request = transfer.NewRequest();
  const std::vector<absl::string_view> names = {"state.0", "state.1", "state.2", "state.3"};
  std::vector<std::vector<uint8_t>> fetched(names.size(), std::vector<uint8_t>(each));
  std::vector<FetchKey> keys;
  for (size_t i = 0; i < names.size(); ++i) {
    keys.push_back(RegionKey(1, 1, std::string(names[i]), request));
    ASSERT_OK(ExpectRegion(transfer, keys.back(), 1, fetched[i]));
  }
  const absl::Status asked = transfer.RequestRegions(1, 1, 1, names, request);
  ASSERT_OK(transfer.Collect({keys[0], keys[1]}, asked));
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(fetched[i] == std::vector<uint8_t>(state.begin() + i * each,
                                                    state.begin() + (i + 1) * each))
        << names[i];
  }
  for (size_t i = 2; i < names.size(); ++i) {
    const absl::Status refused = transfer.Collect({keys[i]}, asked);
    EXPECT_STATUS(refused, absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(refused.message(),
                                  absl::StrCat("region '", names[i], "' (", each,
                                               " bytes) would take its request past 1048576")))
        << refused;
  }

  // Split in two, the rank's state is of regions larger than the bound: each comes alone.
  cluster.node(1).store.SplitState(2);
  ASSERT_NO_FATAL_FAILURE(CommitStep(cluster, 2));
  const uint64_t half = (kBytes + 1) / 2;
  std::vector<uint8_t> first(half);
  ASSERT_GT(half, RegionRequest::kMaxBytes);
  ASSERT_OK(Fetch(cluster, 1, 2, 1, "state.0", first));
  const std::vector<uint8_t> step2 = testing::StateOf(1, 2, kBytes);
  EXPECT_TRUE(first == std::vector<uint8_t>(step2.begin(), step2.begin() + half));
}

// A fetch that names a region twice (a damaged record naming it twice) would leave one of its
// buffers unfilled and its fetch waiting: it is refused at once, registering none of its regions.
TEST(RegionRequestsTest, AFetchNamingARegionTwiceIsRefusedRegisteringNone) {
  InProcessCluster cluster(3, 2, 1);
  Transfer& transfer = cluster.node(0).transfer;
  const int64_t request = transfer.NewRequest();
  std::vector<uint8_t> first(4096), second(4096), other(4096);
  const FetchKey key = RegionKey(1, 1, "state", request);
  const absl::Status twice = transfer.Expect(
      {{RegionKey(1, 1, "other", request), {.buffer = other.data(), .bytes = 4096, .source = 1}},
       {key, {.buffer = first.data(), .bytes = 4096, .source = 1}},
       {key, {.buffer = second.data(), .bytes = 4096, .source = 1}}});
  EXPECT_STATUS(twice, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(twice.message(), "is expected twice in one fetch")) << twice;
  EXPECT_EQ(transfer.FetchesWaiting().first, 0u);
}

// Node 1's rank 1 commits step 1 as kManyRegions regions "state.0", "state.1", ... of
// kManyRegionBytes (the last shorter).
constexpr int kManyRegions = 100;  // of 31,581 bytes, 16 a request: 7 requests
constexpr uint64_t kManyRegionBytes = (kBytes + kManyRegions - 1) / kManyRegions;
void CommitManyRegions(InProcessCluster& cluster) {
  cluster.election().Elect(0);
  cluster.node(1).store.SplitState(kManyRegions);
  ASSERT_NO_FATAL_FAILURE(CommitStep(cluster, 1));
}

// What region "state.`i`" of CommitManyRegions holds (the state is made once, not per region).
std::vector<uint8_t> ManyRegionBytes(int i) {
  static const std::vector<uint8_t> state = testing::StateOf(1, 1, kBytes);
  const uint64_t from = i * kManyRegionBytes;
  return {state.begin() + from, state.begin() + std::min(from + kManyRegionBytes, kBytes)};
}

// A rank of many small regions restored onto another node from its live holder: the regions go in
// many requests (16 regions a request here, 4 requests in flight), and each lands in the rank byte
// for byte. Fetched bytes damaged in the holder's memory fail their chunk CRCs as they are
// written, and the regions are decoded from the group instead.
TEST(RegionRequestsTest, ARankOfManyRegionsIsRestoredElsewhereInManyRequests) {
  InProcessCluster cluster(3, 2, 1);
  ASSERT_NO_FATAL_FAILURE(CommitManyRegions(cluster));
  auto expect_restored = [&](uint32_t rank) {
    for (int i = 0; i < kManyRegions; ++i) {
      EXPECT_TRUE(cluster.node(0).store.WrittenOf(rank, absl::StrCat("state.", i)) ==
                  ManyRegionBytes(i))
          << "region " << i << " of rank " << rank;
    }
  };
  RemoteRestore& restore = cluster.node(0).remote_restore;
  absl::StatusOr<v1::RestoreResponse> fetched = restore.RestoreFrom(100, 1, {});
  ASSERT_OK(fetched);
  EXPECT_EQ(fetched->source_node(), 1u);
  EXPECT_FALSE(fetched->decoded());
  expect_restored(100);

  cluster.node(1).store.FlipCommittedByte(37 * kManyRegionBytes + 5);
  absl::StatusOr<v1::RestoreResponse> decoded = restore.RestoreFrom(101, 1, {});
  ASSERT_OK(decoded);
  EXPECT_TRUE(decoded->decoded());
  expect_restored(101);
  EXPECT_EQ(cluster.node(0).transfer.FetchesWaiting().first, 0u) << "a fetch left keys behind";
}

// A restore writes each request's regions into the rank while later requests are in flight, and
// decodes from the group only the regions whose fetched bytes fail their stored checksums: every
// region is written once.
TEST(RegionRequestsTest, RegionsAreWrittenAsTheirRequestsArriveAndOnlyDamagedOnesAreDecoded) {
  InProcessCluster cluster(3, 2, 1);
  ASSERT_NO_FATAL_FAILURE(CommitManyRegions(cluster));
  cluster.node(1).store.FlipCommittedByte(37 * kManyRegionBytes + 5);
  Transfer& transfer = cluster.node(0).transfer;
  std::optional<size_t> awaited_at_first_write;
  cluster.node(0).store.BeforeWrite([&] {
    if (!awaited_at_first_write) awaited_at_first_write = transfer.FetchesWaiting().first;
  });

  absl::StatusOr<v1::RestoreResponse> restored =
      cluster.node(0).remote_restore.RestoreFrom(100, 1, {});
  ASSERT_OK(restored);
  EXPECT_TRUE(restored->decoded());
  ASSERT_TRUE(awaited_at_first_write.has_value());
  EXPECT_GT(*awaited_at_first_write, 0u) << "the first region was written once all had arrived";
  for (int i = 0; i < kManyRegions; ++i) {
    const std::string region = absl::StrCat("state.", i);
    EXPECT_TRUE(cluster.node(0).store.WrittenOf(100, region) == ManyRegionBytes(i)) << region;
    EXPECT_EQ(cluster.node(0).store.WritesOf(100, region), 1) << region;
  }
  EXPECT_EQ(transfer.FetchesWaiting().first, 0u) << "a fetch left keys behind";
}

TEST(RegionRequestsTest, AFetchFromANodeLostBeforeItSentFailsWithoutWaitingOutItsTimeout) {
  InProcessCluster cluster(3, 2, 1);
  cluster.election().Elect(0);
  ASSERT_NO_FATAL_FAILURE(CommitStep(cluster, 1));
  Transfer& transfer = cluster.node(0).transfer;
  std::vector<uint8_t> fetched(kBytes);
  const FetchKey key = RegionKey(1, 2, "state", transfer.NewRequest());
  ASSERT_OK(ExpectRegion(transfer, key, 2, fetched));
  cluster.Lose(2);  // before it was asked: nothing of it will come
  const absl::Status collected = transfer.Collect({key}, absl::OkStatus());
  EXPECT_STATUS(collected, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(collected.message(), "node 2 was lost before sending it"))
      << collected;
}

TEST(RegionRequestsTest, OnAnAuthenticatedConnectionANodeAsksForItselfAndOnlyTheNodeAskedRefuses) {
  InProcessCluster cluster(3, 2, 1);
  cluster.election().Elect(0);
  ASSERT_NO_FATAL_FAILURE(CommitStep(cluster, 1));
  Transfer& holder = cluster.node(1).transfer;
  FrameHeader request = StateFrame(FrameKind::kRegionRequest, 0);
  request.region.clear();  // named in the payload
  const absl::StatusOr<std::vector<uint8_t>> payload = EncodeRegionRequest(0, {"state"});
  ASSERT_OK(payload);
  const absl::Status elsewhere = holder.Accept(request, *payload, 2);
  EXPECT_STATUS(elsewhere, absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(elsewhere.message(), "node 2 asked for regions of rank 1 to be "
                                                     "sent to node 0"))
      << elsewhere;

  // Node 0 awaits the region from node 1: a refusal from node 2 is refused, and the fetch goes on.
  Transfer& transfer = cluster.node(0).transfer;
  std::vector<uint8_t> fetched(kBytes);
  const int64_t token = transfer.NewRequest();
  const FetchKey key = RegionKey(1, 1, "state", token);
  ASSERT_OK(ExpectRegion(transfer, key, 1, fetched));
  const FrameHeader refusal = StateFrame(FrameKind::kRegionRefused, token);
  const std::string why = "not today";
  const std::vector<uint8_t> reason(why.begin(), why.end());
  const absl::Status forged = transfer.Accept(refusal, reason, 2);
  EXPECT_STATUS(forged, absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(forged.message(), "node 2 refused region 'state' of rank 1"))
      << forged;
  ASSERT_OK(transfer.Collect({key}, transfer.RequestRegions(1, 1, 1, {"state"}, token)));
  EXPECT_TRUE(fetched == testing::StateOf(1, 1, kBytes));
}

// A connection the data plane closed loses the frames its peer wrote behind the one refused: the
// fetches awaiting that peer fail at once, the others wait on. An authenticated peer is known by
// its node; a plaintext one only by its address, which every node of this cluster shares.
TEST(RegionRequestsTest, AClosedConnectionFailsTheFetchesAwaitingItsPeerAtOnce) {
  InProcessCluster cluster(3, 2, 1);
  Transfer& transfer = cluster.node(0).transfer;
  const int64_t token = transfer.NewRequest();
  std::vector<uint8_t> from1(4096), from2(4096);
  const FetchKey key1 = RegionKey(1, 1, "state", token);
  const FetchKey key2 = RegionKey(1, 2, "state", token);
  ASSERT_OK(ExpectRegion(transfer, key1, 1, from1));
  ASSERT_OK(ExpectRegion(transfer, key2, 2, from2));
  const absl::Status why = absl::DataLossError("frame header CRC-32C is 1, the header says 2");
  transfer.ConnectionClosed(2, "127.0.0.1", why);
  const absl::Status failed = transfer.Collect({key2}, absl::OkStatus());
  EXPECT_STATUS(failed, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(failed.message(), "node 2's frames may be lost")) << failed;
  EXPECT_TRUE(absl::StrContains(failed.message(), "frame header CRC-32C")) << failed;
  transfer.ConnectionClosed(std::nullopt, "10.1.2.3", why);  // no node of the job is there

  // The fetch from node 1 still takes its bytes.
  FrameHeader answer = StateFrame(FrameKind::kFetchedRegion, token);
  answer.length = 4096;
  absl::StatusOr<std::optional<FrameSink::InPlace>> into = transfer.Reserve(answer, 1);
  ASSERT_OK(into) << "the fetch from node 1 failed too";
  ASSERT_TRUE(into->has_value());
  transfer.Filled(answer, absl::OkStatus());
  EXPECT_OK(transfer.Collect({key1}, absl::OkStatus()));

  const FetchKey again = RegionKey(1, 1, "state", transfer.NewRequest());
  ASSERT_OK(ExpectRegion(transfer, again, 1, from1));
  transfer.ConnectionClosed(std::nullopt, "127.0.0.1", why);
  EXPECT_STATUS(transfer.Collect({again}, absl::OkStatus()), absl::StatusCode::kUnavailable);
}

// Parity deltas come from a node's group only: a member's closed connection fails the parity
// still waiting for its data, another group's does not. Node 4 is at position 1 of its group.
TEST(RegionRequestsTest, AClosedConnectionFromAMemberFailsTheParityStillWaitingForData) {
  InProcessCluster cluster(6, 2, 1);  // groups {0, 1, 2} and {3, 4, 5}
  NodeUnits& node = cluster.node(3);
  const uint64_t unit = node.context.layout().unit_bytes();
  ASSERT_OK(node.parity.Begin(1, 1, {unit, unit, unit}, nullptr));
  const absl::Status why = absl::DataLossError("payload CRC-32C is 1, the frame says 2");
  node.transfer.ConnectionClosed(1, "127.0.0.1", why);
  EXPECT_STATUS(node.parity.WaitComplete(1, absl::Now() + absl::Milliseconds(1)),
                absl::StatusCode::kDeadlineExceeded);
  node.transfer.ConnectionClosed(4, "127.0.0.1", why);
  const absl::Status failed = node.parity.WaitComplete(1, absl::InfiniteFuture());
  EXPECT_STATUS(failed, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(failed.message(), "node 4 at 127.0.0.1: DATA_LOSS")) << failed;
  EXPECT_EQ(node.transfer.ConnectionsClosed().first, 2u);
}

// A refusal's reason is bounded, and what the holder wrote reaches logs and errors only as
// printable text.
TEST(RegionRequestsTest, ARefusalsReasonIsBoundedAndPrintable) {
  InProcessCluster cluster(3, 2, 1);
  Transfer& transfer = cluster.node(0).transfer;
  std::vector<uint8_t> fetched(4096);
  const int64_t token = transfer.NewRequest();
  const FetchKey key = RegionKey(1, 1, "state", token);
  ASSERT_OK(ExpectRegion(transfer, key, 1, fetched));
  const FrameHeader refusal = StateFrame(FrameKind::kRegionRefused, token);
  EXPECT_STATUS(transfer.Accept(refusal, std::vector<uint8_t>(1025, 'x'), 1),
                absl::StatusCode::kInvalidArgument);
  const std::string why = "no\n\x1b[31mred\xff";
  ASSERT_OK(transfer.Accept(refusal, std::vector<uint8_t>(why.begin(), why.end()), 1));
  const absl::Status collected = transfer.Collect({key}, absl::OkStatus());
  EXPECT_STATUS(collected, absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(collected.message(), "node 1 refused it: no??[31mred?"))
      << collected;
}

// A fetch given up on (here: before its request could be answered) may still be answered: the
// region's frames (unchecked: the holder's chunk may be damaged) and a refusal naming a request
// this node made are read and dropped, the connection kept; those naming a request it never made
// are refused. A new fetch of the same region is not disturbed by the late answer.
TEST(RegionRequestsTest, AnswersThatComeAfterTheirFetchEndedAreDropped) {
  InProcessCluster cluster(3, 2, 1);
  cluster.election().Elect(0);
  ASSERT_NO_FATAL_FAILURE(CommitStep(cluster, 1));
  Transfer& transfer = cluster.node(0).transfer;
  std::vector<uint8_t> given_up(kBytes);
  const int64_t token = transfer.NewRequest();
  const FetchKey key = RegionKey(1, 1, "state", token);
  ASSERT_OK(ExpectRegion(transfer, key, 1, given_up));
  ASSERT_OK(transfer.RequestRegions(1, 1, 1, {"state"}, token));
  EXPECT_STATUS(transfer.Collect({key}, absl::CancelledError("given up")),
                absl::StatusCode::kCancelled);

  FrameHeader late = StateFrame(FrameKind::kFetchedRegion, token);
  late.length = 4096;
  absl::StatusOr<std::optional<FrameSink::InPlace>> into = transfer.Reserve(late, 1);
  ASSERT_OK(into);
  ASSERT_TRUE(into->has_value());
  EXPECT_TRUE((*into)->drop) << "a late answer is read and dropped";
  const FrameHeader refusal = StateFrame(FrameKind::kRegionRefused, token);
  EXPECT_OK(transfer.Accept(refusal, {}, 1));

  FrameHeader never = late;
  never.attempt = token + 1000;
  EXPECT_STATUS(transfer.Reserve(never, 1).status(), absl::StatusCode::kInvalidArgument);
  never.kind = FrameKind::kRegionRefused;
  EXPECT_STATUS(transfer.Accept(never, {}, 1), absl::StatusCode::kInvalidArgument);

  std::vector<uint8_t> fetched(kBytes);
  ASSERT_OK(Fetch(cluster, 1, 1, 1, "state", fetched));
  EXPECT_TRUE(fetched == testing::StateOf(1, 1, kBytes));
}

}  // namespace
}  // namespace moesnap::daemon::cluster
