// The job the ettr and sparse suites model, described once so that both speak of the same job.
//
// DeepSeek-MoE-16B (16.4e9 parameters, 2.8e9 activated per token) trained on 8 nodes of 8 A100s:
// the routed experts are parallel over the nodes and every other tensor's state is sharded over them
// (ZeRO), so a node holds 1/8 of the state. An iteration (one optimizer step) takes 1.5 s: 64 A100s
// at 40% of their 312 TFLOP/s, 0.7M tokens per step at 6 x 2.8e9 FLOP per token. Full state is 12
// bytes per parameter (fp32 master weights and two fp32 Adam moments), weights 2 (bf16); RNG, loss
// scale and data position add 1 MiB at every step. Nodes are linked at 200 Gb/s each.
#ifndef MOESNAP_BENCH_MODELLED_JOB_H_
#define MOESNAP_BENCH_MODELLED_JOB_H_

#include <cstdint>
#include <vector>

#include "moesnap/sparse_schedule.h"

namespace moesnap::bench::modelled_job {

constexpr double kPublishedParameters = 16.4e9;
constexpr int kRoutedExperts = 64;  // per MoE layer; each node holds kRoutedExperts / kNodes of them
constexpr int kNodes = 8;
constexpr double kIterationSeconds = 1.5;
constexpr double kFullStateBytesPerParameter = 12;
constexpr double kWeightBytesPerParameter = 2;
constexpr uint64_t kEveryStepBytes = 1 << 20;
constexpr double kLineRateBitsPerSecond = 200e9;

// The full state one node holds.
constexpr double NodeStateBytes() {
  return kPublishedParameters * kFullStateBytesPerParameter / kNodes;
}

// One node's share of the job's state as the operators a sparse schedule orders: node 0's routed
// experts of each MoE layer and 1/kNodes of every other tensor, from the published config.
struct NodeShare {
  std::vector<Operator> operators;
  double node_parameters = 0;
};
NodeShare NodeShareOfTheJob();

}  // namespace moesnap::bench::modelled_job

#endif  // MOESNAP_BENCH_MODELLED_JOB_H_
