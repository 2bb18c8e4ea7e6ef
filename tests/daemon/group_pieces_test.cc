// Assembling a replica group's region from its members' pieces: the cover check, and the fetch of
// the pieces other nodes hold, fed hostile answers at the fetch seam.
#include "daemon/group_pieces.h"

#include <gtest/gtest.h>

#include <map>
#include <tuple>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "proto/restored_regions.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

v1::ReplicaGroupStep Layout(std::vector<uint32_t> ranks) {
  v1::ReplicaGroupStep layout;
  layout.mutable_group()->set_name("data-parallel");
  for (uint32_t rank : ranks) layout.mutable_group()->add_ranks(rank);
  layout.set_step(7);
  return layout;
}

TEST(CheckGroupCoverTest, PiecesInAnyOrderCoveringTheRegionOnceGiveTheirStep) {
  const v1::ReplicaGroupStep layout = Layout({0, 1, 2});
  absl::StatusOr<int64_t> step = CheckGroupCover(
      "w", layout, {{2, 7, 8192, 1000, 9192}, {0, 7, 0, 4096, 9192}, {1, 7, 4096, 4096, 9192}});
  ASSERT_OK(step);
  EXPECT_EQ(*step, 7);
}

TEST(CheckGroupCoverTest, AGapAnOverlapAMixedStepOrSizeOrNothingIsRefused) {
  const v1::ReplicaGroupStep layout = Layout({0, 1});
  EXPECT_STATUS(CheckGroupCover("w", layout, {{0, 7, 0, 4096, 9000}, {1, 7, 4097, 4903, 9000}}),
                absl::StatusCode::kDataLoss);
  EXPECT_STATUS(CheckGroupCover("w", layout, {{0, 7, 0, 4096, 9000}, {1, 7, 4095, 4905, 9000}}),
                absl::StatusCode::kDataLoss);
  EXPECT_STATUS(CheckGroupCover("w", layout, {{0, 7, 0, 4096, 9000}}), absl::StatusCode::kDataLoss);
  EXPECT_STATUS(CheckGroupCover("w", layout, {{0, 7, 0, 4096, 9000}, {1, 6, 4096, 4904, 9000}}),
                absl::StatusCode::kFailedPrecondition);
  EXPECT_STATUS(CheckGroupCover("w", layout, {{0, 7, 0, 4096, 9000}, {1, 7, 4096, 4904, 9001}}),
                absl::StatusCode::kFailedPrecondition);
  EXPECT_STATUS(CheckGroupCover("w", layout, {}), absl::StatusCode::kDataLoss);
  // Sizes near 2^64 do not wrap into a cover.
  EXPECT_STATUS(CheckGroupCover("w", layout, {{0, 7, 0, 4096, 9000}, {1, 7, 4096, ~0ull, 9000}}),
                absl::StatusCode::kDataLoss);
}

// A fake of the elastic-restore path: what each member's node answers.
struct FakeNodes {
  std::map<uint32_t, absl::StatusOr<v1::RestoreResponse>> answers;
  std::map<uint32_t, std::vector<std::string>> asked;
  FetchPieces Fetch() {
    return [this](uint32_t member, const std::vector<std::string>& regions) {
      asked[member] = regions;
      auto it = answers.find(member);
      return it == answers.end() ? absl::StatusOr<v1::RestoreResponse>(absl::NotFoundError("none"))
                                 : it->second;
    };
  }
};

void AddPiece(v1::RestoreResponse& response, const std::string& region, int64_t step,
              uint64_t offset, uint64_t bytes, uint64_t region_bytes,
              const std::string& group = "data-parallel") {
  v1::RegionPiece piece;
  piece.set_replica_group(group);
  piece.set_offset(offset);
  piece.set_region_bytes(region_bytes);
  AddRestored(*response.mutable_restored(), region, step, bytes, &piece);
}

v1::RestoreResponse Pieces(const std::vector<std::tuple<std::string, int64_t, uint64_t, uint64_t>>& pieces,
                           uint64_t region_bytes, const std::string& group = "data-parallel") {
  v1::RestoreResponse response;
  for (const auto& [region, step, offset, bytes] : pieces) {
    AddPiece(response, region, step, offset, bytes, region_bytes, group);
  }
  return response;
}

// Rank 0's restore wrote its own piece [0, 4096) of "w" (8192 bytes); rank 1's is on another node.
std::vector<GroupRegion> HalfHeldHere() {
  return {{"w", Layout({0, 1}), {{0, 7, 0, 4096, 8192}}, {1}}};
}

v1::RestoreResponse Response() {
  v1::RestoreResponse response;
  AddRestored(*response.mutable_restored(), "w", 0, 4096);
  return response;
}

TEST(FetchRemotePiecesTest, TheOtherMembersPiecesCompleteTheCoverAndGiveTheStep) {
  FakeNodes nodes;
  nodes.answers.emplace(1, Pieces({{"w", 7, 4096, 4096}}, 8192));
  v1::RestoreResponse response = Response();
  ASSERT_OK(FetchRemotePieces(HalfHeldHere(), nodes.Fetch(), &response));
  EXPECT_EQ(nodes.asked[1], std::vector<std::string>{"w"});
  EXPECT_EQ(response.restored().steps(0), 7);
}

TEST(FetchRemotePiecesTest, OneFetchPerMemberForAllItsRegions) {
  // Both regions lie in member 2's shard alone (member 0's pieces are empty).
  v1::RestoreResponse two = Pieces({{"a", 7, 0, 100}}, 100);
  AddPiece(two, "b", 7, 0, 4096, 4096);
  FakeNodes nodes;
  nodes.answers.emplace(2, two);
  std::vector<GroupRegion> regions{{"a", Layout({0, 2}), {}, {2}}, {"b", Layout({0, 2}), {}, {2}}};
  v1::RestoreResponse response;
  ASSERT_OK(FetchRemotePieces(regions, nodes.Fetch(), &response));
  EXPECT_EQ(nodes.asked.size(), 1u);
  EXPECT_EQ(nodes.asked[2], (std::vector<std::string>{"a", "b"}));
}

TEST(FetchRemotePiecesTest, ARegionAskedOfAnotherMemberIsRefused) {
  // "a" lies in member 1's shard, "b" in member 2's; member 1 answers with "b" as well.
  v1::RestoreResponse one = Pieces({{"a", 7, 0, 100}}, 100);
  AddPiece(one, "b", 7, 0, 4096, 4096);
  FakeNodes nodes;
  nodes.answers.emplace(1, one);
  nodes.answers.emplace(2, Pieces({{"b", 7, 0, 4096}}, 4096));
  std::vector<GroupRegion> regions{{"a", Layout({0, 1}), {}, {1}}, {"b", Layout({0, 2}), {}, {2}}};
  v1::RestoreResponse response;
  const absl::Status status = FetchRemotePieces(regions, nodes.Fetch(), &response);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "gave region 'b', which was not asked of it"))
      << status;
}

TEST(FetchRemotePiecesTest, HostileOrStaleAnswersAreRefused) {
  const std::map<std::string, absl::StatusOr<v1::RestoreResponse>> hostile{
      {"overlapping", Pieces({{"w", 7, 4095, 4097}}, 8192)},
      {"short", Pieces({{"w", 7, 4096, 4095}}, 8192)},
      {"another size", Pieces({{"w", 7, 4096, 4096}}, 8193)},
      {"another step", Pieces({{"w", 6, 4096, 4096}}, 8192)},
      {"another group", Pieces({{"w", 7, 4096, 4096}}, 8192, "other")},
      {"not asked", Pieces({{"x", 7, 4096, 4096}}, 8192)},
      {"whole region", [] {
         v1::RestoreResponse whole = Pieces({{"w", 7, 0, 8192}}, 8192);
         whole.mutable_restored()->clear_pieces();
         return whole;
       }()},
      {"columns that disagree", [] {
         v1::RestoreResponse cut = Pieces({{"w", 7, 4096, 4096}}, 8192);
         cut.mutable_restored()->mutable_names()->pop_back();
         return cut;
       }()},
      {"empty handed", absl::NotFoundError("rank 1 has none of the regions asked for")},
  };
  for (const auto& [what, answer] : hostile) {
    FakeNodes nodes;
    nodes.answers.emplace(1, answer);
    v1::RestoreResponse response = Response();
    const absl::Status status = FetchRemotePieces(HalfHeldHere(), nodes.Fetch(), &response);
    EXPECT_FALSE(status.ok()) << what;
    EXPECT_NE(status.code(), absl::StatusCode::kUnavailable) << what << ": " << status;
  }
}

TEST(FetchRemotePiecesTest, AFetchThatFailsSaysWhichMember) {
  FakeNodes nodes;
  nodes.answers.emplace(1, absl::UnavailableError("node 1 does not answer"));
  v1::RestoreResponse response = Response();
  const absl::Status status = FetchRemotePieces(HalfHeldHere(), nodes.Fetch(), &response);
  ASSERT_STATUS(status, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(status.message(), "rank 1")) << status;
}

}  // namespace
}  // namespace moesnap::daemon
