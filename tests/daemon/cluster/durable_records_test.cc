// Which step is durable on every node, from the keys etcd holds: each node's record of its durable
// steps and the step decisions. Records and decisions are untrusted: gaps, a node missing, a step
// whose decision is aborted or missing, and garbage of every kind.
#include "daemon/cluster/durable_records.h"

#include <gtest/gtest.h>

#include <limits>

#include "proto/moesnap.pb.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon::cluster {
namespace {

constexpr uint64_t kDigest = 0x1234abcd5678ef00;
const EtcdKeys kKeys("job");
const JobLayout kLayout{.node_count = 3, .cluster_digest = kDigest};

etcd::KeyValue RecordKey(uint32_t node, const std::vector<int64_t>& steps,
                         uint64_t digest = kDigest) {
  return {.key = kKeys.Durable(node), .value = DurableRecordValue(node, digest, steps)};
}

etcd::KeyValue DecisionKey(int64_t step, bool committed) {
  v1::StepDecision decision;
  decision.set_step(step);
  decision.set_committed(committed);
  decision.set_token(7);
  return {.key = kKeys.Step(step), .value = decision.SerializeAsString()};
}

// Decisions of `steps`, every one committed.
std::vector<etcd::KeyValue> Committed(const std::vector<int64_t>& steps) {
  std::vector<etcd::KeyValue> decisions;
  for (int64_t step : steps) decisions.push_back(DecisionKey(step, true));
  return decisions;
}

durable::DurableEverywhere Decide(const std::vector<etcd::KeyValue>& records,
                                  const std::vector<etcd::KeyValue>& decisions) {
  return NewestDurableEverywhere(kKeys, kLayout, records, decisions);
}

TEST(DurableRecordsTest, TheNewestStepEveryNodeListsAndThatIsCommitted) {
  const durable::DurableEverywhere answer =
      Decide({RecordKey(0, {2, 4, 6}), RecordKey(1, {4, 6}), RecordKey(2, {2, 4, 6, 8})},
             Committed({2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(answer.step, 6) << answer.reason;
}

TEST(DurableRecordsTest, GapsInARecordLeaveTheStepsItLacksOut) {
  const durable::DurableEverywhere answer =
      Decide({RecordKey(0, {2, 4, 6}), RecordKey(1, {2, 6}), RecordKey(2, {2, 4})},
             Committed({2, 4, 6}));
  EXPECT_EQ(answer.step, 2) << answer.reason;  // 4 is not on node 1, 6 not on node 2
}

TEST(DurableRecordsTest, ANodeWithoutARecordMeansNoStepIsDurableEverywhere) {
  const durable::DurableEverywhere answer =
      Decide({RecordKey(0, {2, 4}), RecordKey(2, {2, 4})}, Committed({2, 4}));
  EXPECT_EQ(answer.step, std::nullopt);
  EXPECT_NE(answer.reason.find("node 1"), std::string::npos) << answer.reason;
}

TEST(DurableRecordsTest, AStepWhoseDecisionIsAbortedIsPassedOver) {
  std::vector<etcd::KeyValue> decisions = Committed({2, 3, 4, 5});
  decisions.push_back(DecisionKey(6, false));
  const durable::DurableEverywhere answer =
      Decide({RecordKey(0, {4, 6}), RecordKey(1, {4, 6}), RecordKey(2, {4, 6})}, decisions);
  EXPECT_EQ(answer.step, 4) << answer.reason;
  EXPECT_NE(answer.reason.find("step 6 was aborted"), std::string::npos) << answer.reason;
}

TEST(DurableRecordsTest, AStepWithoutADecisionIsPassedOverUnlessItsDecisionWasDropped) {
  const std::vector<etcd::KeyValue> records = {RecordKey(0, {2, 4, 6, 9}), RecordKey(1, {2, 4, 6, 9}),
                                               RecordKey(2, {2, 4, 6, 9})};
  // etcd holds the decisions of steps 5 to 8: 9 was never decided, 6 is committed.
  durable::DurableEverywhere answer = Decide(records, Committed({5, 6, 7, 8}));
  EXPECT_EQ(answer.step, 6) << answer.reason;
  EXPECT_NE(answer.reason.find("step 9 has no decision"), std::string::npos) << answer.reason;
  // Without 6's decision, although older decisions are held: 6 was never decided.
  answer = Decide(records, Committed({5, 7, 8}));
  EXPECT_EQ(answer.step, 4) << answer.reason;  // dropped before 5, the oldest held: decided
  EXPECT_NE(answer.reason.find("step 5"), std::string::npos) << answer.reason;
  // No decision held at all: nothing can be shown committed.
  answer = Decide(records, {});
  EXPECT_EQ(answer.step, std::nullopt) << answer.reason;
}

TEST(DurableRecordsTest, AnUnreadableDecisionIsNotACommit) {
  std::vector<etcd::KeyValue> decisions = Committed({2, 3, 4});
  decisions.push_back({.key = kKeys.Step(6), .value = "\xff\xff garbage"});
  v1::StepDecision elsewhere;  // a decision of another step under step 8's key
  elsewhere.set_step(5);
  elsewhere.set_committed(true);
  decisions.push_back({.key = kKeys.Step(8), .value = elsewhere.SerializeAsString()});
  const durable::DurableEverywhere answer = Decide(
      {RecordKey(0, {4, 6, 8}), RecordKey(1, {4, 6, 8}), RecordKey(2, {4, 6, 8})}, decisions);
  EXPECT_EQ(answer.step, 4) << answer.reason;
  EXPECT_NE(answer.reason.find("decision of step 6 cannot be read"), std::string::npos)
      << answer.reason;
}

TEST(DurableRecordsTest, GarbageRecordsCountAsNoRecordAndAreNamed) {
  const std::vector<etcd::KeyValue> decisions = Committed({2, 4});
  const etcd::KeyValue good0 = RecordKey(0, {2, 4}), good2 = RecordKey(2, {2, 4});
  v1::DurableRecord record;
  record.set_node_id(1);
  record.set_cluster_digest(kDigest);
  record.add_steps(4);
  record.add_steps(2);  // out of order
  v1::DurableRecord duplicate = record;
  duplicate.clear_steps();
  duplicate.add_steps(2);
  duplicate.add_steps(2);
  v1::DurableRecord too_many;
  too_many.set_node_id(1);
  too_many.set_cluster_digest(kDigest);
  for (int step = 0; step <= kMaxDurableRecordSteps; ++step) too_many.add_steps(step);
  const std::vector<std::pair<etcd::KeyValue, std::string>> garbage = {
      {{.key = kKeys.Durable(1), .value = "\xff\x01 not a record"}, "does not hold a record"},
      {{.key = kKeys.Durable(1), .value = std::string(kMaxDurableRecordBytes + 1, '\0')},
       "more than the"},
      {{.key = kKeys.Durable(1), .value = DurableRecordValue(2, kDigest, {2, 4})},
       "the record of node 2"},
      {RecordKey(1, {2, 4}, kDigest + 1), "another cluster config"},
      {{.key = kKeys.Durable(1), .value = record.SerializeAsString()}, "after step 4"},
      {{.key = kKeys.Durable(1), .value = duplicate.SerializeAsString()}, "after step 2"},
      {{.key = kKeys.Durable(1), .value = too_many.SerializeAsString()}, "steps, more than"},
  };
  for (const auto& [kv, problem] : garbage) {
    const durable::DurableEverywhere answer = Decide({good0, kv, good2}, decisions);
    EXPECT_EQ(answer.step, std::nullopt) << problem;
    EXPECT_NE(answer.reason.find("node 1"), std::string::npos) << answer.reason;
    EXPECT_NE(answer.reason.find(problem), std::string::npos) << answer.reason;
  }
}

TEST(DurableRecordsTest, KeysThatAreNotANodeOfTheLayoutAreIgnored) {
  const durable::DurableEverywhere answer = Decide(
      {RecordKey(0, {2, 4}), RecordKey(1, {2, 4}), RecordKey(2, {2, 4}),
       RecordKey(3, {2}),  // node 3 is not in a layout of 3 nodes
       {.key = kKeys.Durable(1) + "x", .value = "garbage"},
       {.key = kKeys.Durables() + "01", .value = DurableRecordValue(1, kDigest, {2})},
       {.key = kKeys.Durables() + "-1", .value = "garbage"}},
      Committed({2, 4}));
  EXPECT_EQ(answer.step, 4) << answer.reason;
}

TEST(DurableRecordsTest, ARecordKeepsTheNewestStepsAndParsesBack) {
  std::vector<int64_t> steps;
  for (int64_t step = 1; step <= kMaxDurableRecordSteps + 10; ++step) steps.push_back(step);
  const etcd::KeyValue kv = RecordKey(1, steps);
  EXPECT_LE(kv.value.size(), kMaxDurableRecordBytes);
  absl::StatusOr<std::vector<int64_t>> parsed = ParseDurableRecord(kv, 1, kDigest);
  ASSERT_OK(parsed);
  ASSERT_EQ(parsed->size(), static_cast<size_t>(kMaxDurableRecordSteps));
  EXPECT_EQ(parsed->front(), 11);
  EXPECT_EQ(parsed->back(), kMaxDurableRecordSteps + 10);
}

TEST(DurableRecordsTest, TheOldestRecordedStepComesFromValidRecordsOfTheLayoutOnly) {
  EXPECT_EQ(OldestRecordedStep(kKeys, kLayout, {}), std::nullopt);
  EXPECT_EQ(OldestRecordedStep(kKeys, kLayout,
                               {RecordKey(0, {6, 8}), RecordKey(1, {4, 8}), RecordKey(2, {}),
                                RecordKey(3, {1}),  // not a node of the layout
                                RecordKey(2, {2}, kDigest + 1),  // another config
                                {.key = kKeys.Durable(2), .value = "garbage"}}),
            4);
}

TEST(DurableRecordsTest, DecisionsOfRecordedStepsAreKeptWithinABound) {
  EXPECT_EQ(ForgetBound(100, std::nullopt), 100);  // nothing recorded: as before
  EXPECT_EQ(ForgetBound(100, 120), 100);           // recorded steps are newer
  EXPECT_EQ(ForgetBound(100, 40), 40);             // kept from the oldest recorded step
  // A node that stopped recording long ago keeps no more than kMaxSparedDecisions.
  EXPECT_EQ(ForgetBound(10'000, 2), 10'000 - kMaxSparedDecisions);
  EXPECT_EQ(ForgetBound(std::numeric_limits<int64_t>::min() + 5, std::numeric_limits<int64_t>::min()),
            std::numeric_limits<int64_t>::min());
}

}  // namespace
}  // namespace moesnap::daemon::cluster
