// Byte counts as people write them in configs and on command lines ("4MiB", "8 GiB", 1048576) and
// as tools print them.
#ifndef MOESNAP_COMMON_BYTE_SIZE_H_
#define MOESNAP_COMMON_BYTE_SIZE_H_

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace moesnap {

// Accepts an integer with an optional B, KiB, MiB, GiB or TiB suffix (powers of 1024; spaces
// allowed before the suffix). Decimal units (KB, MB) are rejected as ambiguous.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// "256.0 MiB", "12 B".
std::string FormatByteSize(uint64_t bytes);

}  // namespace moesnap

#endif  // MOESNAP_COMMON_BYTE_SIZE_H_
