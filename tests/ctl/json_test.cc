// moesnapctl's JSON: 64-bit numbers as numbers, enum values as short words, unset optional fields
// left out, strings escaped, and the error object.
#include "client/ctl/json.h"

#include <gtest/gtest.h>

#include "proto/moesnap.pb.h"

namespace moesnap::ctl {
namespace {

TEST(JsonTest, PrintsSixtyFourBitNumbersAsNumbersAndEnumsAsWords) {
  v1::VersionInfo version;
  version.set_rank(3);
  version.set_region("layer0.\"gate\"\n");
  version.set_step(int64_t{1} << 53);
  version.set_state(v1::STEP_STATE_COMMITTED);
  version.set_bytes(UINT64_MAX);
  version.add_shape(-1);
  version.add_shape(4096);
  EXPECT_EQ(Json(version),
            "{\"rank\":3,\"region\":\"layer0.\\\"gate\\\"\\n\",\"step\":9007199254740992,"
            "\"state\":\"committed\",\"bytes\":18446744073709551615,\"dtype\":\"\","
            "\"shape\":[-1,4096],\"chunks\":0}\n");
}

TEST(JsonTest, LeavesOutUnsetOptionalFieldsAndKeepsEveryOther) {
  v1::LatestCommittedResponse empty;
  EXPECT_EQ(Json(empty), "{\"tier\":\"unspecified\"}\n");  // a plain field is always there
  v1::LatestCommittedResponse latest;
  latest.set_step(0);  // present though zero
  EXPECT_EQ(Json(latest), "{\"step\":0,\"tier\":\"unspecified\"}\n");
  v1::RebuildResponse rebuild;
  rebuild.set_seconds(0.1);
  EXPECT_EQ(Json(rebuild),
            "{\"step\":0,\"stripes\":0,\"data_bytes\":0,\"parity_bytes\":0,\"fetched_bytes\":0,"
            "\"seconds\":0.1,\"helper_fetched_bytes\":0}\n");
}

TEST(JsonTest, EnumWordDropsTheTypePrefix) {
  EXPECT_EQ(EnumWord(*v1::StepState_descriptor()->FindValueByNumber(v1::STEP_STATE_ABORTED)),
            "aborted");
  EXPECT_EQ(EnumWord(*v1::StepState_descriptor()->FindValueByNumber(v1::STEP_STATE_UNSPECIFIED)),
            "unspecified");
}

TEST(JsonTest, ErrorObjectCarriesCodeMessageAndExitCode) {
  EXPECT_EQ(JsonError("not_found", "step 41 is not \"stored\"", 4),
            "{\"error\":{\"code\":\"not_found\",\"message\":\"step 41 is not \\\"stored\\\"\","
            "\"exit_code\":4}}\n");
  EXPECT_EQ(JsonString(std::string("a\x01z", 3)), "\"a\\u0001z\"");
}

}  // namespace
}  // namespace moesnap::ctl
