// The modelled job's node share, from DeepSeek-MoE-16B's published config.
#include "bench/modelled_job.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moesnap::bench::modelled_job {
namespace {

// DeepSeek-MoE-16B as published (the config of deepseek-moe-16b-base): 28 layers, hidden size 2048,
// multi-head attention (q, k, v, o: 4 hidden x hidden matrices, no biases), SwiGLU feed-forward
// blocks (3 matrices), RMSNorm. Layer 0 is dense (intermediate size 10944); layers 1-27 are MoE,
// each with 64 routed experts and 2 shared experts of intermediate size 1408 and a 64-way gate.
// The vocabulary is 102400; embedding and head are not tied. 16.4e9 parameters, 2.8e9 activated.
constexpr double kHidden = 2048;
constexpr double kVocabulary = 102400;
constexpr int kLayers = 28;
constexpr int kDenseLayers = 1;
constexpr double kDenseIntermediate = 10944;
constexpr int kSharedExperts = 2;
constexpr double kExpertIntermediate = 1408;

}  // namespace

NodeShare NodeShareOfTheJob() {
  NodeShare table;
  auto add = [&](std::string name, bool is_expert, double parameters) {
    table.operators.push_back({.name = std::move(name),
                               .is_expert = is_expert,
                               .full_state_bytes = static_cast<uint64_t>(
                                   parameters * kFullStateBytesPerParameter),
                               .weight_bytes = static_cast<uint64_t>(
                                   parameters * kWeightBytesPerParameter),
                               .token_count = 0});
    table.node_parameters += parameters;
  };
  const double attention = 4 * kHidden * kHidden + 2 * kHidden;  // and the layer's two norms
  const double expert = 3 * kHidden * kExpertIntermediate;
  for (int layer = 0; layer < kLayers; ++layer) {
    if (layer < kDenseLayers) {
      add(absl::StrCat("layer", layer, ".dense"), false,
          (attention + 3 * kHidden * kDenseIntermediate) / kNodes);
      continue;
    }
    for (int index = 0; index < kRoutedExperts / kNodes; ++index) {
      add(absl::StrCat("layer", layer, ".expert", index), true, expert);
    }
    // Attention, shared experts and gate: the layer's non-expert operator.
    add(absl::StrCat("layer", layer, ".dense"), false,
        (attention + kSharedExperts * expert + kRoutedExperts * kHidden) / kNodes);
  }
  add("embedding", false, kVocabulary * kHidden / kNodes);
  add("head", false, (kVocabulary * kHidden + kHidden) / kNodes);  // and the final norm
  return table;
}

}  // namespace moesnap::bench::modelled_job
