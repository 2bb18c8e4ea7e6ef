// LoadRankFromDisk: the rank's regions of the manifest, read through the step reader.
#include "daemon/durable/disk_restore.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace moesnap::daemon::durable {

std::optional<v1::JournalRank> RankRecord(const v1::DurableManifest& manifest, uint32_t rank) {
  for (const v1::JournalRank& record : manifest.ranks()) {
    if (record.rank() == rank) return record;
  }
  return std::nullopt;
}

absl::Status LoadRankFromDisk(DurableStore* store, const StepReader& step, uint32_t rank) {
  const v1::DurableManifest& manifest = step.manifest();
  const std::optional<v1::JournalRank> record = RankRecord(manifest, rank);
  if (!record) {
    return absl::NotFoundError(absl::StrCat("durable step ", manifest.step(), " of node ",
                                            manifest.node_id(), " holds nothing of rank ", rank));
  }
  std::vector<v1::ImageRegion> regions;
  std::vector<int> indices;  // in the manifest
  for (int i = 0; i < manifest.regions_size(); ++i) {
    if (manifest.regions(i).region().rank() != rank) continue;
    regions.push_back(manifest.regions(i).region());
    indices.push_back(i);
  }
  return store->AdoptCommitted(rank, regions, *record,
                               [&step, &indices](int region, uint32_t chunk, uint8_t* out) {
                                 return step.ReadChunk(indices[region], chunk, out);
                               });
}

}  // namespace moesnap::daemon::durable
