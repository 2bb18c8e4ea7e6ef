// Fuzzes the daemon's config parser (TOML text, its [cluster] section included): any text is either
// refused with a status naming the key, or gives options whose checks hold.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "daemon/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<moesnap::daemon::DaemonOptions> options =
      moesnap::daemon::ParseDaemonOptions(text, "fuzz.toml");
  if (!options.ok() || !options->cluster) return 0;
  // A parsed cluster section has a valid shape, so the digest and groups are computed safely.
  const moesnap::daemon::ClusterOptions& cluster = *options->cluster;
  if (!cluster.ValidateShape().ok()) std::abort();
  (void)cluster.Digest();
  if (cluster.node_count <= 4096) {
    for (uint32_t id = 0; id < cluster.node_count; ++id) (void)cluster.GroupOf(id);
  }
  return 0;
}
