// RemoteRestore: locate the holder, fetch from it or decode its units, write into the rank.
#include "daemon/cluster/remote_restore.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <string_view>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "daemon/cluster/parallel.h"
#include "daemon/frame.h"
#include "proto/restored_regions.h"

namespace moesnap::daemon::cluster {
namespace {

// Region requests this node has in flight to one holder, all restores together: half of what a
// holder serves of one node, so that restores of many ranks at once queue here instead of being
// refused there. A restore keeps this many requests in flight.
constexpr size_t kRequestsInFlight = Transfer::kRegionRequestsPerPeer / 2;
// Memory kept for the next restores' fetched bytes: 16 experts of 4 MiB. A restore of more takes
// fresh memory, and gives it back.
constexpr uint64_t kKeptRestoreBytes = 64 << 20;

// Which member of the group `record` describes holds `rank`, with the record (without parity).
v1::LocateRankResponse FindRank(const v1::JournalCluster& record, uint32_t rank) {
  v1::LocateRankResponse response;
  for (const v1::NodeImage& image : record.group_images()) {
    for (const v1::ImageRegion& region : image.regions()) {
      if (region.rank() != rank) continue;
      response.set_found(true);
      response.set_node_id(image.node_id());
      *response.mutable_record() = record;
      response.mutable_record()->clear_parity();
      return response;
    }
  }
  return response;
}

}  // namespace

RemoteRestore::RemoteRestore(const ClusterContext& context, ClusterStore* store,
                             Transfer* transfer, Rebuilder* rebuilder)
    : context_(context),
      store_(store),
      transfer_(transfer),
      rebuilder_(rebuilder),
      buffers_(kKeptRestoreBytes) {}

v1::LocateRankResponse RemoteRestore::Locate(const v1::LocateRankRequest& request) const {
  return FindRank(*store_->ClusterRecord(), request.rank());
}

void RemoteRestore::TakeRequests(uint32_t holder, size_t count) {
  absl::MutexLock lock(&requests_mutex_);
  while (requests_in_flight_[holder] + count > kRequestsInFlight) {
    requests_ended_.Wait(&requests_mutex_);
  }
  requests_in_flight_[holder] += count;
}

void RemoteRestore::ReleaseRequests(uint32_t holder, size_t count) {
  absl::MutexLock lock(&requests_mutex_);
  if ((requests_in_flight_[holder] -= count) == 0) requests_in_flight_.erase(holder);
  requests_ended_.SignalAll();
}

absl::StatusOr<v1::LocateRankResponse> RemoteRestore::Located(uint32_t source_rank, bool ask,
                                                               bool* asked) {
  *asked = false;
  const std::shared_ptr<const v1::JournalCluster> own = store_->ClusterRecord();
  const int64_t committed = own->committed_step();
  if (!ask) {
    {
      absl::MutexLock lock(&located_mutex_);
      std::erase_if(located_, [&](const auto& entry) {
        return entry.second.record().committed_step() != committed;
      });
      if (auto it = located_.find(source_rank);
          it != located_.end() && context_.nodes->Live(it->second.node_id())) {
        return it->second;
      }
    }
    // A rank of this node's group: this node's own record says which member holds it.
    if (!rebuilder_->behind()) {
      v1::LocateRankResponse here = FindRank(*own, source_rank);
      if (here.found()) return here;
    }
  }
  *asked = true;
  // Any live node of the rank's group knows; the newest committed record wins.
  const std::vector<uint32_t> nodes = context_.nodes->LiveIds();
  absl::Mutex found_mutex;
  std::optional<v1::LocateRankResponse> found;
  InParallel(nodes, [&](uint32_t id) -> absl::Status {
    v1::LocateRankRequest request;
    request.set_rank(source_rank);
    absl::StatusOr<v1::LocateRankResponse> response = context_.peers->LocateRank(id, request);
    if (response.ok() && response->found()) {
      absl::MutexLock lock(&found_mutex);
      if (!found || response->record().committed_step() > found->record().committed_step()) {
        found = *std::move(response);
      }
    }
    return response.status();
  });
  if (!found) {
    return absl::NotFoundError(
        absl::StrCat("no live node of the cluster knows rank ", source_rank));
  }
  if (found->record().committed_step() == committed) {
    absl::MutexLock lock(&located_mutex_);
    located_[source_rank] = *found;
  }
  return *std::move(found);
}

void RemoteRestore::ForgetLocation(uint32_t source_rank) {
  absl::MutexLock lock(&located_mutex_);
  located_.erase(source_rank);
}

absl::Status RemoteRestore::FetchFromHolder(uint32_t holder, int64_t step, uint32_t source_rank,
                                            absl::Span<const WantedRegion> wanted,
                                            Collected collected) {
  if (wanted.empty()) return absl::OkStatus();
  // The request token makes the keys this fetch's alone, though other restores on this node may
  // fetch some of the same regions at once.
  const int64_t request = transfer_->NewRequest();
  std::vector<FetchKey> keys;
  std::vector<std::pair<FetchKey, FetchSlot>> slots;
  for (const WantedRegion& region : wanted) {
    keys.push_back({step, 0, 0, source_rank, region.region->region(), request});
    // Every byte is checked against the region's stored chunk CRCs as RestoreLocated writes it
    // into the rank (which decodes the regions from the group when they differ).
    slots.push_back({keys.back(), {.buffer = region.bytes.data(),
                                   .bytes = region.bytes.size(),
                                   .source = holder,
                                   .owner_checks = true}});
  }
  // The regions in requests: [starts[i], starts[i + 1]) is request i's. A request names up to
  // RegionRequest::kMaxRegions regions (one holder task sends them back to back) of at most
  // RegionRequest::kMaxBytes together; a larger region goes alone, and the holder serves such
  // requests of this node side by side on its threads.
  std::vector<size_t> starts = {0};
  uint64_t request_bytes = 0;
  for (size_t i = 0; i < wanted.size(); ++i) {
    const uint64_t bytes = wanted[i].region->bytes();
    // request_bytes + bytes > kMaxBytes, without overflow.
    const bool over = bytes > RegionRequest::kMaxBytes ||
                      request_bytes > RegionRequest::kMaxBytes - bytes;
    if (i > starts.back() && (i - starts.back() == RegionRequest::kMaxRegions || over)) {
      starts.push_back(i);
      request_bytes = 0;
    }
    request_bytes += bytes;
  }
  starts.push_back(wanted.size());
  const size_t requests = starts.size() - 1;
  if (absl::Status expected = transfer_->Expect(slots); !expected.ok()) return expected;
  // Up to kRequestsInFlight requests go out at once (taken together, so that restores never each
  // hold part of what they wait for); each request answered makes room for the next.
  const size_t window = std::min(kRequestsInFlight, requests);
  TakeRequests(holder, window);
  auto ask = [&](size_t i) {
    std::vector<absl::string_view> names;
    for (size_t r = starts[i]; r < starts[i + 1]; ++r) names.push_back(wanted[r].region->region());
    return transfer_->RequestRegions(holder, step, source_rank, names, request);
  };
  absl::Status status;
  size_t asked = 0;
  while (asked < window && status.ok()) status = ask(asked++);
  size_t finished = 0;  // requests collected (their keys forgotten), whether or not they arrived
  while (finished < asked && status.ok()) {
    const size_t first = starts[finished];
    const size_t end = starts[finished + 1];
    status = transfer_->Collect({keys.begin() + first, keys.begin() + end}, absl::OkStatus());
    ++finished;
    if (!status.ok()) break;
    // The next request goes out first, so that the holder sends it while these are taken.
    if (asked < requests) status = ask(asked++);
    if (absl::Status taken = collected(wanted.subspan(first, end - first)); status.ok()) {
      status = taken;
    }
  }
  ReleaseRequests(holder, window);
  // Regions not received after a failure are no longer awaited either.
  if (finished < requests) {
    (void)transfer_->Collect({keys.begin() + starts[finished], keys.end()}, status);
  }
  return status;
}

absl::Status RemoteRestore::DecodeFromGroup(const v1::JournalCluster& record, int group,
                                            int position, absl::Span<const WantedRegion> wanted) {
  const erasure::StripeLayout& layout = context_.layout();
  // Decode the holder's units that cover the regions from its group's survivors, each once.
  std::set<uint64_t> stripes;
  for (const WantedRegion& region : wanted) {
    if (region.bytes.empty()) continue;
    for (uint64_t unit = region.start / layout.unit_bytes();
         unit <= (region.start + region.bytes.size() - 1) / layout.unit_bytes(); ++unit) {
      stripes.insert(layout.DataUnitLocation(position, unit).stripe);
    }
  }
  DecodeTarget target{record, group, position,
                      [&](uint64_t unit, const uint8_t* data, uint64_t length) {
                        const uint64_t unit_start = unit * layout.unit_bytes();
                        for (const WantedRegion& region : wanted) {
                          const uint64_t from = std::max(unit_start, region.start);
                          const uint64_t to = std::min(unit_start + length,
                                                       region.start + region.bytes.size());
                          if (from < to) {
                            std::memcpy(region.bytes.data() + (from - region.start),
                                        data + (from - unit_start), to - from);
                          }
                        }
                      },
                      nullptr};
  v1::RebuildResponse stats;
  return rebuilder_->Decode(target, {stripes.begin(), stripes.end()}, &stats);
}

absl::StatusOr<v1::RestoreResponse> RemoteRestore::RestoreFrom(
    uint32_t rank, uint32_t source_rank, const std::vector<std::string>& names) {
  // This node's own committed state first; NOT_FOUND means the rank ran elsewhere.
  absl::StatusOr<v1::RestoreResponse> local = store_->RestoreFromRank(rank, source_rank, names);
  if (local.ok()) local->set_source_node(context_.node_id());
  if (!absl::IsNotFound(local.status())) return local;
  // A location known here (kept, or this node's group) whose holder fails is asked of every node.
  for (bool ask : {false, true}) {
    bool asked = false;
    absl::StatusOr<v1::LocateRankResponse> found = Located(source_rank, ask, &asked);
    if (!found.ok()) return found.status();
    absl::StatusOr<v1::RestoreResponse> restored =
        RestoreLocated(rank, source_rank, names, *found, asked);
    if (restored.ok() || asked) return restored;
    ForgetLocation(source_rank);
  }
  return absl::InternalError("unreachable: the second attempt asks every node");
}

absl::StatusOr<v1::RestoreResponse> RemoteRestore::RestoreLocated(
    uint32_t rank, uint32_t source_rank, const std::vector<std::string>& names,
    const v1::LocateRankResponse& found, bool decode_if_fetch_fails) {
  const erasure::StripeLayout& layout = context_.layout();
  const v1::JournalCluster& record = found.record();
  const int64_t step = record.committed_step();
  const std::optional<std::pair<int, int>> place = context_.options().GroupOf(found.node_id());
  if (!place || record.group_images_size() != layout.group_size()) {
    return absl::DataLossError(absl::StrCat("node ", found.node_id(), "'s group record of rank ",
                                            source_rank, " does not fit the cluster's groups"));
  }
  if (absl::Status checked = CheckGroupRecord(record, context_.topology->groups[place->first],
                                              context_.topology->limits);
      !checked.ok()) {
    return absl::DataLossError(absl::StrCat("node ", found.node_id(), "'s group record of rank ",
                                            source_rank, ": ", checked.message()));
  }
  const auto [group, position] = *place;
  const v1::NodeImage& holder_image = record.group_images(position);

  // The requested regions of the rank, with their offsets in the holder's image. CheckGroupRecord
  // bounded the image's regions, so their sizes sum without overflow.
  const absl::flat_hash_set<std::string_view> named(names.begin(), names.end());
  std::vector<WantedRegion> wanted;
  uint64_t offset = 0;
  for (const v1::ImageRegion& region : holder_image.regions()) {
    offset += region.bytes();
    if (region.rank() != source_rank) continue;
    if (!names.empty() && !named.contains(region.region())) continue;
    wanted.push_back({&region, offset - region.bytes(), {}});
  }
  if (wanted.empty()) {
    return absl::NotFoundError(
        absl::StrCat("rank ", source_rank, " has none of the regions asked for"));
  }
  // From the holder while it is live; it refuses a step it does not hold (rebuilding, or past it).
  // Otherwise decoded from the group's survivors, and so for the rest of the restore once a fetch
  // fails and the location was just asked of every node (a kept one is asked again first).
  bool holder_failed = !context_.nodes->Live(found.node_id());
  bool decoded_any = false;
  // The regions go in batches of at most cluster.restore_buffer_bytes (or one region, when it is
  // larger), each fetched into host memory and written into the rank before the next: a rank of
  // many GiB restored here does not take its size again in this daemon's memory.
  const uint64_t batch_bytes = context_.options().restore_buffer_bytes;
  for (size_t first = 0; first < wanted.size();) {
    size_t end = first;
    uint64_t bytes = 0;
    while (end < wanted.size() &&
           (end == first ||
            (bytes < batch_bytes && wanted[end].region->bytes() <= batch_bytes - bytes))) {
      bytes += wanted[end++].region->bytes();
    }
    const absl::Span<WantedRegion> batch(wanted.data() + first, end - first);
    absl::StatusOr<bool> decoded = RestoreBatch(rank, source_rank, found, group, position, bytes,
                                                batch, decode_if_fetch_fails, holder_failed);
    if (!decoded.ok()) return decoded.status();
    decoded_any = decoded_any || *decoded;
    first = end;
  }
  v1::RestoreResponse response;
  response.set_step(step);
  ReserveRestored(*response.mutable_restored(), static_cast<int>(wanted.size()));
  response.set_source_node(found.node_id());
  response.set_decoded(decoded_any);
  for (const WantedRegion& region : wanted) {
    AddRestored(*response.mutable_restored(), region.region->region(), region.region->step(),
                region.region->bytes(),
                region.region->has_piece() ? &region.region->piece() : nullptr);
  }
  Log(LogLevel::kInfo, "restored ", wanted.size(), " regions of rank ", source_rank,
      " (node ", found.node_id(), decoded_any ? ", decoded from its group" : ", fetched",
      ") into rank ", rank);
  return response;
}

absl::StatusOr<bool> RemoteRestore::RestoreBatch(uint32_t rank, uint32_t source_rank,
                                                 const v1::LocateRankResponse& found, int group,
                                                 int position, uint64_t bytes,
                                                 absl::Span<WantedRegion> batch,
                                                 bool decode_if_fetch_fails, bool& holder_failed) {
  const v1::JournalCluster& record = found.record();
  const KeptBuffers::Lease buffer = buffers_.Take(bytes);
  uint8_t* next = buffer.data();
  for (WantedRegion& region : batch) {
    region.bytes = {next, region.region->bytes()};
    next += region.region->bytes();
  }
  // Each chunk is checked against its stored CRC-32C as it is written into the rank.
  auto write = [&](const WantedRegion& region) {
    return store_->WriteRegion(rank, *region.region,
                               PoolBytes::View(region.bytes.data(), region.bytes.size()));
  };
  // The regions to decode from the group: fetched ones that fail their check (damaged on the way,
  // or in the holder's memory), and those the holder did not send.
  std::vector<WantedRegion> from_group;
  if (holder_failed) {
    from_group.assign(batch.begin(), batch.end());
  } else {
    size_t received = 0;
    absl::Status write_failed;
    const absl::Status fetched = FetchFromHolder(
        found.node_id(), record.committed_step(), source_rank, batch,
        [&](absl::Span<const WantedRegion> regions) {
          received += regions.size();
          for (const WantedRegion& region : regions) {
            absl::Status written = write(region);
            if (absl::IsDataLoss(written)) {
              if (from_group.empty()) {
                Log(LogLevel::kWarning, "rank ", source_rank, "'s region fetched from node ",
                    found.node_id(), " fails its stored checksums (", written.ToString(),
                    "): decoding it from its group");
              }
              from_group.push_back(region);
            } else if (!written.ok()) {
              write_failed = written;
              return written;
            }
          }
          return absl::OkStatus();
        });
    if (!write_failed.ok()) return write_failed;
    if (!fetched.ok()) {
      if (!decode_if_fetch_fails) return fetched;
      Log(LogLevel::kWarning, "rank ", source_rank, "'s regions could not be fetched from node ",
          found.node_id(), " (", fetched.ToString(), "): decoding ", batch.size() - received,
          " of them from its group");
      holder_failed = true;
      from_group.insert(from_group.end(), batch.begin() + received, batch.end());
    }
  }
  if (from_group.empty()) return false;
  if (absl::Status status = DecodeFromGroup(record, group, position, from_group); !status.ok()) {
    return status;
  }
  for (const WantedRegion& region : from_group) {
    if (absl::Status status = write(region); !status.ok()) return status;
  }
  return true;
}

}  // namespace moesnap::daemon::cluster
