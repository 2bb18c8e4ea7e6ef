// moesnapctl's JSON: one object per command for scripts. Unlike protobuf's canonical JSON mapping,
// 64-bit integers are JSON numbers (jq and Python read them exactly) and enum values are the short
// lower-case word people read in the tables ("committed", not "STEP_STATE_COMMITTED"). Every field
// is present; an `optional` field that is unset is left out. Errors have their own object.
#ifndef MOESNAP_CLIENT_CTL_JSON_H_
#define MOESNAP_CLIENT_CTL_JSON_H_

#include <string>

#include "absl/strings/string_view.h"
#include "common/json_text.h"  // JsonString, for the commands that print JSON by hand
#include "google/protobuf/message.h"

namespace moesnap::ctl {

// The message as one line of JSON, with a newline.
std::string Json(const google::protobuf::Message& message);

// {"error":{"code":"not_found","message":"...","exit_code":4}} and a newline. `code` is the
// lower-case status code name ("unavailable", "invalid_argument", "usage").
std::string JsonError(absl::string_view code, absl::string_view message, int exit_code);

// The short word for an enum value: its name without the prefix its type's name gives it
// (StepState's STEP_STATE_COMMITTED is "committed"), in lower case.
std::string EnumWord(const google::protobuf::EnumValueDescriptor& value);

}  // namespace moesnap::ctl

#endif  // MOESNAP_CLIENT_CTL_JSON_H_
