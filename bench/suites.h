// Every benchmark suite of moesnap-bench, each a function that appends its figures to a report.
#ifndef MOESNAP_BENCH_SUITES_H_
#define MOESNAP_BENCH_SUITES_H_

#include "absl/status/status.h"
#include "bench/report.h"

namespace moesnap::bench {

absl::Status RunErasureSuite(Report& report);
absl::Status RunCaptureSuite(Report& report);
// Data-parallel replicas on one daemon, unsharded and one shard each, for N = 1, 2, 4.
absl::Status RunReplicaSuite(Report& report);
absl::Status RunDataPlaneSuite(Report& report);
absl::Status RunClusterSuite(Report& report);
// A real etcd started by the suite: a fenced decision and a lease keep-alive round trip.
absl::Status RunEtcdSuite(Report& report);
// UNAVAILABLE (and skipped by `all`) without the Python interpreter that has torch.
absl::Status RunPeersSuite(Report& report);
// The DeepSeek-MoE-16B schedule rows always; the daemon rows are UNAVAILABLE (and skipped by `all`)
// without the Python interpreter that has torch.
absl::Status RunSparseSuite(Report& report);
// A node lost by a four-node MoE job, survived without restarting the survivors, beside a restart
// of the whole job; UNAVAILABLE (and skipped by `all`) without the interpreter that has torch.
absl::Status RunElasticSuite(Report& report);
// Drains to the machine's disk against a plain write and torch.save of the same bytes; the
// trainer's stall during a drain. torch.save is left out without the Python interpreter.
absl::Status RunDurableSuite(Report& report);
// A model fed with the figures of the suites that ran before it in the same run.
absl::Status RunEttrSuite(Report& report);
// UNAVAILABLE (and skipped by `all`) where no GPU is usable.
absl::Status RunGpuSuite(Report& report);

}  // namespace moesnap::bench

#endif  // MOESNAP_BENCH_SUITES_H_
