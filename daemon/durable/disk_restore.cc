// RestoreFromDisk: names resolved against the manifest, bytes through the store's region writer.
#include "daemon/durable/disk_restore.h"

#include "absl/strings/str_cat.h"

namespace moesnap::daemon::durable {

std::optional<v1::JournalRank> RankRecord(const v1::DurableManifest& manifest, uint32_t rank) {
  for (const v1::JournalRank& record : manifest.ranks()) {
    if (record.rank() == rank) return record;
  }
  return std::nullopt;
}

absl::StatusOr<v1::RestoreResponse> RestoreFromDisk(DurableStore* store, const StepReader& step,
                                                    uint32_t rank,
                                                    const std::vector<std::string>& regions) {
  const v1::DurableManifest& manifest = step.manifest();
  const std::optional<v1::JournalRank> record = RankRecord(manifest, rank);
  if (!record) {
    return absl::NotFoundError(absl::StrCat("durable step ", manifest.step(), " of node ",
                                            manifest.node_id(), " holds nothing of rank ", rank));
  }
  std::vector<std::string> names = regions;
  if (names.empty()) names = store->RegisteredRegions(rank);
  if (names.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " has no registered regions to restore into: register them first"));
  }
  // Every name must be in the step before any byte is written.
  std::vector<int> indices;
  for (const std::string& name : names) {
    absl::StatusOr<int> index = step.Find(rank, name);
    if (!index.ok()) return index.status();
    indices.push_back(*index);
  }
  v1::RestoreResponse response;
  response.set_step(record->latest_committed_step());
  response.set_tier(v1::TIER_DURABLE);
  for (int index : indices) {
    const v1::ImageRegion& region = manifest.regions(index).region();
    absl::Status status = store->WriteRegionFrom(
        rank, region, [&step, index](uint64_t offset, uint64_t length, uint8_t* out) {
          return step.ReadChunkAt(index, offset, length, out);
        });
    if (!status.ok()) return status;
    v1::RestoreResponse::Restored* restored = response.add_regions();
    restored->set_region(region.region());
    restored->set_step(region.step());
    restored->set_bytes(region.bytes());
  }
  return response;
}

}  // namespace moesnap::daemon::durable
