// UpstreamLog in process: what one fetch answers stays under the message limit of its callers.
#include "daemon/upstream_log.h"

#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

v1::LogRecord Record(int64_t step, uint32_t micro_batch, uint32_t peer_rank, size_t bytes) {
  v1::LogRecord record;
  record.set_rank(1);
  record.set_step(step);
  record.set_micro_batch(micro_batch);
  record.set_direction(v1::LOG_DIRECTION_FORWARD);
  record.set_peer_rank(peer_rank);
  record.set_payload(std::string(bytes, static_cast<char>('a' + micro_batch % 26)));
  return record;
}

TEST(UpstreamLogTest, OneFetchAnswerStaysUnderTheMessageLimit) {
  UpstreamLog log(0, {.max_bytes = uint64_t{1} << 30}, [](const std::set<uint32_t>&) {
    return std::optional<int64_t>();
  });
  constexpr size_t kRecordBytes = 4 << 20;
  const uint32_t fitting = static_cast<uint32_t>(UpstreamLog::kMaxFetchBytes / (kRecordBytes + 4096));
  for (uint32_t micro_batch = 0; micro_batch < fitting; ++micro_batch) {
    ASSERT_OK(log.Append(Record(5, micro_batch, 2, kRecordBytes)));
  }
  absl::StatusOr<v1::AppendLogResponse> past = log.Append(Record(5, fitting + 1, 2, kRecordBytes));
  ASSERT_STATUS(past, absl::StatusCode::kResourceExhausted);
  EXPECT_NE(past.status().message().find("more than one fetch answers"), std::string::npos)
      << past.status();
  // The step is marked, so its fetch says why instead of answering part of it ...
  v1::FetchLogRequest request;
  request.set_rank(1);
  request.set_step(5);
  request.set_direction(v1::LOG_DIRECTION_FORWARD);
  request.set_peer_rank(2);
  EXPECT_STATUS(log.Fetch(request), absl::StatusCode::kDataLoss);
  // ... while the records to another neighbour, and of another step, have their own answer.
  ASSERT_OK(log.Append(Record(5, 0, 3, kRecordBytes)));
  ASSERT_OK(log.Append(Record(6, 0, 2, kRecordBytes)));
  request.set_step(6);
  absl::StatusOr<v1::FetchLogResponse> fetched = log.Fetch(request);
  ASSERT_OK(fetched);
  EXPECT_EQ(fetched->records_size(), 1);
  EXPECT_LT(fetched->ByteSizeLong(), size_t{64} << 20);
}

}  // namespace
}  // namespace moesnap::daemon
