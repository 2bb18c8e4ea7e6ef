// ParseByteSize and FormatByteSize.
#include "common/byte_size.h"

#include <array>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace moesnap {
namespace {
constexpr std::array<std::pair<absl::string_view, int>, 5> kUnits = {
    {{"TiB", 40}, {"GiB", 30}, {"MiB", 20}, {"KiB", 10}, {"B", 0}}};
}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  absl::string_view number = absl::StripAsciiWhitespace(text);
  int shift = 0;
  for (const auto& [suffix, unit_shift] : kUnits) {
    if (number.size() > suffix.size() && number.substr(number.size() - suffix.size()) == suffix) {
      number = absl::StripTrailingAsciiWhitespace(number.substr(0, number.size() - suffix.size()));
      shift = unit_shift;
      break;
    }
  }
  uint64_t value = 0;
  if (!absl::SimpleAtoi(number, &value) || number.empty() || !absl::ascii_isdigit(number[0])) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a byte size: expected an integer with an optional B, KiB, MiB, GiB "
        "or TiB suffix"));
  }
  if (shift > 0 && value > (UINT64_MAX >> shift)) {
    return absl::InvalidArgumentError(absl::StrCat("byte size '", text, "' overflows 64 bits"));
  }
  return value << shift;
}

std::string FormatByteSize(uint64_t bytes) {
  for (const auto& [suffix, shift] : kUnits) {
    if (shift > 0 && bytes >= (uint64_t{1} << shift)) {
      return absl::StrFormat("%.1f %s", static_cast<double>(bytes) / (uint64_t{1} << shift),
                             suffix);
    }
  }
  return absl::StrCat(bytes, " B");
}

}  // namespace moesnap
