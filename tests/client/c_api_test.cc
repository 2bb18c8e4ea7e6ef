// The C ABI (moesnap/moesnap.h) through the shared library a C caller loads: status codes and
// this thread's message, arguments refused by name, the shared-memory file, the schedule's worked
// example and the planner's JSON. Calls that need a daemon are exercised by the Python package's
// tests and the installed-package test, which go through this ABI end to end.
#include "moesnap/moesnap.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <thread>
#include <vector>

namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;

constexpr moesnap_status kInvalidArgument = 3;
constexpr moesnap_status kOutOfRange = 11;
constexpr moesnap_status kResourceExhausted = 8;
constexpr moesnap_status kUnavailable = 14;

std::string TakeString(char* text) {
  std::string copy(text);
  moesnap_free(text);
  return copy;
}

TEST(CAbiTest, ReportsItsVersionsAndStatusNames) {
  EXPECT_EQ(moesnap_abi_version(), static_cast<uint32_t>(MOESNAP_C_ABI_VERSION));
  EXPECT_THAT(moesnap_version(), MatchesRegex("[0-9]+\\.[0-9]+\\.[0-9]+"));
  EXPECT_STREQ(moesnap_status_name(MOESNAP_OK), "OK");
  EXPECT_STREQ(moesnap_status_name(5), "NOT_FOUND");
  EXPECT_STREQ(moesnap_status_name(16), "UNAUTHENTICATED");
  EXPECT_STREQ(moesnap_status_name(17), "UNKNOWN");
  EXPECT_STREQ(moesnap_status_name(-1), "UNKNOWN");
}

TEST(CAbiTest, ConnectingWhereNoDaemonListensFailsAtOnceNamingTheSocket) {
  moesnap_client* client = nullptr;
  EXPECT_EQ(moesnap_client_connect("/nonexistent/moesnap/agent.sock", 0, 5, 5, &client),
            kUnavailable);
  EXPECT_THAT(moesnap_last_error(), HasSubstr("/nonexistent/moesnap/agent.sock"));
  EXPECT_EQ(client, nullptr);  // outputs are written only on success
}

TEST(CAbiTest, RefusesMissingOutputsAndBadTimeoutsByName) {
  EXPECT_EQ(moesnap_client_connect("/nonexistent", 0, 5, 5, nullptr), kInvalidArgument);
  EXPECT_THAT(moesnap_last_error(), HasSubstr("client is NULL"));
  moesnap_client* client = nullptr;
  for (double timeout : std::vector<double>{0.0, -1.0, NAN, INFINITY}) {
    EXPECT_EQ(moesnap_client_connect("/nonexistent", 0, timeout, 5, &client), kInvalidArgument);
    EXPECT_THAT(moesnap_last_error(), HasSubstr("call_timeout_s"));
  }
  EXPECT_EQ(moesnap_client_connect("/nonexistent", int64_t{1} << 40, 5, 5, &client),
            kInvalidArgument);
  EXPECT_THAT(moesnap_last_error(), HasSubstr("rank 1099511627776"));
  EXPECT_EQ(client, nullptr);
}

TEST(CAbiTest, MessagesBelongToTheThreadWhoseCallFailed) {
  moesnap_client* client = nullptr;
  ASSERT_EQ(moesnap_client_connect("/nonexistent/here", 0, 5, 5, &client), kUnavailable);
  std::string other_thread;
  std::thread([&] { other_thread = moesnap_last_error(); }).join();
  EXPECT_EQ(other_thread, "");
  EXPECT_THAT(moesnap_last_error(), HasSubstr("/nonexistent/here"));
}

TEST(CAbiTest, SharedMemoryFileIsReservedAndSealed) {
  int fd = -1;
  ASSERT_EQ(moesnap_shared_memory_create(1 << 20, &fd), MOESNAP_OK) << moesnap_last_error();
  struct stat info {};
  ASSERT_EQ(fstat(fd, &info), 0);
  EXPECT_EQ(info.st_size, 1 << 20);
  const int seals = fcntl(fd, F_GET_SEALS);
  EXPECT_TRUE((seals & F_SEAL_SHRINK) && (seals & F_SEAL_GROW) && (seals & F_SEAL_SEAL));
  EXPECT_NE(ftruncate(fd, 4096), 0);  // the daemon can never fault on a shrunk file
  close(fd);
  EXPECT_EQ(moesnap_shared_memory_create(0, &fd), kInvalidArgument);
  EXPECT_EQ(moesnap_shared_memory_create(4096, nullptr), kInvalidArgument);
}

// The C++ schedule test's worked example: four experts (token counts 40, 10, 30, 20) and a dense
// part, a budget of 33 bytes per step.
std::vector<moesnap_operator> SmallModel() {
  return {{"layer0.expert0", 1, 12, 2, 40}, {"layer0.expert1", 1, 12, 2, 10},
          {"layer0.expert2", 1, 12, 2, 30}, {"layer0.expert3", 1, 12, 2, 20},
          {"layer0.dense", 0, 24, 4, 0}};
}

TEST(CAbiTest, ScheduleGivesTheWorkedExample) {
  const std::vector<moesnap_operator> operators = SmallModel();
  moesnap_schedule* schedule = nullptr;
  ASSERT_EQ(moesnap_schedule_build(operators.data(), operators.size(), 1, 33, 1, &schedule),
            MOESNAP_OK)
      << moesnap_last_error();
  EXPECT_EQ(moesnap_schedule_window(schedule), 3);
  ASSERT_EQ(moesnap_schedule_operator_count(schedule), 5u);
  std::vector<int32_t> order(5);
  moesnap_schedule_order(schedule, order.data());
  EXPECT_EQ(order, (std::vector<int32_t>{1, 3, 2, 0, 4}));
  std::vector<int32_t> captured(5);
  size_t count = 0;
  uint64_t bytes = 0;
  ASSERT_EQ(moesnap_schedule_slot(schedule, 0, &bytes, captured.data(), &count), MOESNAP_OK);
  EXPECT_EQ(std::vector<int32_t>(captured.begin(), captured.begin() + count),
            (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(bytes, 33u);
  EXPECT_EQ(moesnap_schedule_slot(schedule, 3, &bytes, captured.data(), &count), kOutOfRange);
  EXPECT_THAT(moesnap_last_error(), HasSubstr("slot 3 is not in [0, 3)"));
  int32_t by = -1;
  ASSERT_EQ(moesnap_schedule_captured_by(schedule, 3, 0, &by), MOESNAP_OK);
  EXPECT_EQ(by, 1);
  EXPECT_EQ(moesnap_schedule_captured_by(schedule, 5, 0, &by), kOutOfRange);
  EXPECT_EQ(moesnap_schedule_slot_of_step(schedule, 4), 0);
  const int32_t windows[] = {3, 4};
  moesnap_schedule* widened = nullptr;
  ASSERT_EQ(moesnap_schedule_with_window(
                schedule, moesnap_schedule_agreed_window(windows, 2), &widened),
            MOESNAP_OK);
  EXPECT_EQ(moesnap_schedule_window(widened), 4);
  moesnap_schedule_free(widened);
  moesnap_schedule_free(schedule);
}

TEST(CAbiTest, ScheduleOverBudgetSaysByHowMuch) {
  const std::vector<moesnap_operator> operators = SmallModel();
  moesnap_schedule* schedule = nullptr;
  EXPECT_EQ(moesnap_schedule_build(operators.data(), operators.size(), 1, 20, 1, &schedule),
            kResourceExhausted);
  EXPECT_THAT(moesnap_last_error(), HasSubstr("needs 25 bytes"));
  moesnap_operator unnamed = operators[0];
  unnamed.name = nullptr;
  EXPECT_EQ(moesnap_schedule_build(&unnamed, 1, 1, 33, 1, &schedule), kInvalidArgument);
  EXPECT_THAT(moesnap_last_error(), HasSubstr("operators[0].name is NULL"));
  EXPECT_EQ(schedule, nullptr);
}

const std::vector<double> kLoads = {120, 40, 300, 75, 10, 220, 90, 15};

TEST(CAbiTest, PlanIsJsonWithEveryPart) {
  char* json = nullptr;
  ASSERT_EQ(moesnap_plan(kLoads.data(), kLoads.size(), 6, 2, 1, nullptr, 0, &json), MOESNAP_OK)
      << moesnap_last_error();
  const std::string plan = TakeString(json);
  EXPECT_THAT(plan, HasSubstr("\"replicas\":[1,1,4,1,1,2,1,1]"));
  EXPECT_THAT(plan, HasSubstr("{\"failed\":0,\"overlap\":1,\"overlap_interval\":[1,1],"));
  EXPECT_THAT(plan, HasSubstr("\"reconfiguration\":null}"));
  const int32_t failed[] = {1, 4};
  ASSERT_EQ(moesnap_plan(kLoads.data(), kLoads.size(), 6, 2, 1, failed, 2, &json), MOESNAP_OK);
  EXPECT_THAT(TakeString(json), HasSubstr("\"reconfiguration\":{\"survivors\":[0,2,3,5],"));
  EXPECT_EQ(moesnap_plan(kLoads.data(), kLoads.size(), 2, 2, 3, nullptr, 0, &json),
            kInvalidArgument);
  EXPECT_THAT(moesnap_last_error(), HasSubstr("min_replicas 3 exceeds the 2 nodes"));
  EXPECT_EQ(moesnap_plan(nullptr, 8, 6, 2, 1, nullptr, 0, &json), kInvalidArgument);
  EXPECT_THAT(moesnap_last_error(), HasSubstr("loads is NULL"));
}

TEST(CAbiTest, PlacementsAreCheckedBeforeUse) {
  const int32_t experts[] = {0, 1, 7};
  const size_t offsets[] = {0, 2, 3};
  const moesnap_placement placement{experts, offsets, 2};
  char* json = nullptr;
  EXPECT_EQ(moesnap_recovery_probabilities(&placement, 4, &json), kInvalidArgument);
  EXPECT_THAT(moesnap_last_error(), HasSubstr("node 1 holds expert 7, not one of the 4 experts"));
  const size_t decreasing[] = {0, 3, 2};
  const moesnap_placement backwards{experts, decreasing, 2};
  EXPECT_EQ(moesnap_recovery_probabilities(&backwards, 8, &json), kInvalidArgument);
  EXPECT_THAT(moesnap_last_error(), HasSubstr("offsets decrease at node 1"));
  ASSERT_EQ(moesnap_recovery_probabilities(&placement, 8, &json), MOESNAP_OK);
  // 8 experts, 3 of them held: none survives for sure.
  EXPECT_THAT(TakeString(json), HasSubstr("{\"failed\":0,\"probability\":0,"));
}

TEST(CAbiTest, ReconfigurationIsJsonWithTransfersFromSurvivors) {
  const std::vector<double> loads = {10, 10, 10, 10};
  const int32_t experts[] = {0, 1, 2, 3, 0, 1, 2, 3};
  const size_t offsets[] = {0, 2, 4, 6, 8};
  const moesnap_placement current{experts, offsets, 4};
  const int32_t failed[] = {0};
  const uint64_t expert_bytes[] = {100, 100, 100, 100};
  char* json = nullptr;
  ASSERT_EQ(moesnap_reconfigure(loads.data(), loads.size(), 4, 2, 1, &current, failed, 1,
                                expert_bytes, &json),
            MOESNAP_OK)
      << moesnap_last_error();
  const std::string plan = TakeString(json);
  EXPECT_THAT(plan, HasSubstr("\"survivors\":[1,2,3]"));
  EXPECT_THAT(plan, HasSubstr("\"placement\":[[],"));
  EXPECT_THAT(plan, Not(HasSubstr("\"from\":0,")));
}

}  // namespace
