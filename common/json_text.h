// JSON text for the values we print by hand (moesnapctl's output, the C ABI's structured results):
// strings escaped, doubles in the shortest form that reads back to the same value.
#ifndef MOESNAP_COMMON_JSON_TEXT_H_
#define MOESNAP_COMMON_JSON_TEXT_H_

#include <string>

#include "absl/strings/string_view.h"

namespace moesnap {

// `text` as a JSON string literal, quotes included.
std::string JsonString(absl::string_view text);
// `value` as a JSON number; NaN and the infinities, which JSON lacks, as the strings "NaN",
// "Infinity" and "-Infinity" (what Python's json module reads back).
std::string JsonNumber(double value);

}  // namespace moesnap

#endif  // MOESNAP_COMMON_JSON_TEXT_H_
