// safetensors files exactly as the format publishes them (github.com/huggingface/safetensors):
// 8 bytes of little-endian header length N, N bytes of a UTF-8 JSON object that starts with '{'
// (padded with spaces to a multiple of 8, so the data starts 8-byte aligned), then the tensors'
// bytes back to back. The object maps each tensor's name to {"dtype", "shape", "data_offsets":
// [begin, end]} (offsets into the data, which they cover whole without gaps or overlaps), plus an
// optional "__metadata__" object of string values.
#ifndef MOESNAP_CLIENT_CTL_SAFETENSORS_H_
#define MOESNAP_CLIENT_CTL_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace moesnap::ctl {

struct SafetensorsDtype {
  std::string name;      // as the format spells it: "F32", "BF16", "I64", "BOOL", ...
  uint32_t element_bytes = 0;
};

// The format's dtype for a region's dtype as trainers register it: PyTorch's names
// ("torch.float32", "torch.bfloat16"), plain ones ("float32", "int64", "bool") or the format's own
// ("F32"). nullopt for anything that is not a tensor element type (a pickle, free-form text).
std::optional<SafetensorsDtype> SafetensorsDtypeOf(absl::string_view dtype);

struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;  // element count x element size
};

// Where each tensor's bytes go in a file: the order its data is laid out in (larger elements
// first, then by name, so every tensor starts aligned to its element size) and each tensor's
// offset from the start of the file.
struct SafetensorsLayout {
  std::string header;                        // the 8-byte length and the padded JSON
  std::map<std::string, uint64_t> offsets;   // tensor name -> file offset of its first byte
  uint64_t file_bytes = 0;
};

// Lays out `tensors` (names unique, not "__metadata__") with `metadata`.
SafetensorsLayout LayOutSafetensors(std::vector<SafetensorsTensor> tensors,
                                    const std::map<std::string, std::string>& metadata);

}  // namespace moesnap::ctl

#endif  // MOESNAP_CLIENT_CTL_SAFETENSORS_H_
