// The elastic suite: an expert-parallel MoE job of four nodes loses one and trains on without
// restarting the survivors (moesnap.elastic), beside a restart of the whole job from the last
// committed snapshot in the same run. The measuring is bench/elastic.py under the Debian
// interpreter that has torch; it starts the moesnapd processes itself, since it SIGKILLs one.
#include "bench/python_script.h"
#include "bench/suites.h"

namespace moesnap::bench {

absl::Status RunElasticSuite(Report& report) {
  return RunPythonScript({.suite = "elastic", .file = "elastic.py", .own_daemons = true}, report);
}

}  // namespace moesnap::bench
