// Safetensors headers: the dtype table, the data layout and the JSON.
#include "client/ctl/safetensors.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "client/ctl/json.h"

namespace moesnap::ctl {

std::optional<SafetensorsDtype> SafetensorsDtypeOf(absl::string_view dtype) {
  static const auto* const kNames = new std::map<std::string, SafetensorsDtype>{
      {"bool", {"BOOL", 1}},       {"uint8", {"U8", 1}},         {"int8", {"I8", 1}},
      {"int16", {"I16", 2}},       {"short", {"I16", 2}},        {"uint16", {"U16", 2}},
      {"float16", {"F16", 2}},     {"half", {"F16", 2}},         {"bfloat16", {"BF16", 2}},
      {"int32", {"I32", 4}},       {"int", {"I32", 4}},          {"uint32", {"U32", 4}},
      {"float32", {"F32", 4}},     {"float", {"F32", 4}},        {"float64", {"F64", 8}},
      {"double", {"F64", 8}},      {"int64", {"I64", 8}},        {"long", {"I64", 8}},
      {"uint64", {"U64", 8}},      {"float8_e4m3fn", {"F8_E4M3", 1}},
      {"float8_e5m2", {"F8_E5M2", 1}},
  };
  for (const auto& [name, type] : *kNames) {
    if (dtype == type.name) return type;  // already the format's spelling
  }
  absl::string_view plain = dtype;
  absl::ConsumePrefix(&plain, "torch.");
  auto it = kNames->find(absl::AsciiStrToLower(plain));
  if (it == kNames->end()) return std::nullopt;
  return it->second;
}

SafetensorsLayout LayOutSafetensors(std::vector<SafetensorsTensor> tensors,
                                    const std::map<std::string, std::string>& metadata) {
  std::sort(tensors.begin(), tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    if (a.dtype.element_bytes != b.dtype.element_bytes) {
      return a.dtype.element_bytes > b.dtype.element_bytes;
    }
    return a.name < b.name;
  });
  std::vector<std::string> entries;
  if (!metadata.empty()) {
    std::vector<std::string> pairs;
    for (const auto& [key, value] : metadata) {
      pairs.push_back(absl::StrCat(JsonString(key), ":", JsonString(value)));
    }
    entries.push_back(absl::StrCat("\"__metadata__\":{", absl::StrJoin(pairs, ","), "}"));
  }
  SafetensorsLayout layout;
  uint64_t offset = 0;
  std::vector<std::pair<std::string, uint64_t>> data_offsets;
  for (const SafetensorsTensor& tensor : tensors) {
    entries.push_back(absl::StrCat(JsonString(tensor.name), ":{\"dtype\":",
                                   JsonString(tensor.dtype.name), ",\"shape\":[",
                                   absl::StrJoin(tensor.shape, ","), "],\"data_offsets\":[", offset,
                                   ",", offset + tensor.bytes, "]}"));
    data_offsets.emplace_back(tensor.name, offset);
    offset += tensor.bytes;
  }
  std::string json = absl::StrCat("{", absl::StrJoin(entries, ","), "}");
  json.append((8 - json.size() % 8) % 8, ' ');
  layout.header.resize(8);
  for (int i = 0; i < 8; ++i) layout.header[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  layout.header += json;
  for (const auto& [name, data_offset] : data_offsets) {
    layout.offsets[name] = layout.header.size() + data_offset;
  }
  layout.file_bytes = layout.header.size() + offset;
  return layout;
}

}  // namespace moesnap::ctl
