// Transfer: frames out to parity holders and rebuilding peers, frames in to parity and fetches.
#include "daemon/cluster/transfer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "daemon/cluster/parallel.h"
#include "erasure/crc32c.h"

namespace moesnap::daemon::cluster {
namespace {

constexpr int kDataConnectionsPerPeer = 2;
// A peer that takes nothing of a frame for this long has stopped reading.
constexpr absl::Duration kDataSendTimeout = absl::Seconds(30);
static_assert(Transfer::kFrameBytes <= Transfer::kMaxFrameBytes);
// The slowest a fetch may arrive (bytes per second) once its bytes started to come.
constexpr double kSlowestFetch = 10e6;
// How often a fetch waiting for its bytes looks whether their sender is still live.
constexpr absl::Duration kSenderCheckInterval = absl::Milliseconds(200);
// Threads serving the regions peers ask for, and how many of them one peer may hold: a peer that
// stops reading holds only those until their sends time out.
constexpr int kRegionServingThreads = 4;
constexpr int kRegionThreadsPerPeer = 2;
// The longest reason a refusal carries.
constexpr size_t kMaxRefusalBytes = 1024;

using FrameParts = absl::Span<const absl::Span<const uint8_t>>;

// Calls send(frame, bytes) for each frame of `pieces`, one after another, cut into frames of
// `frame_bytes` (the last shorter), each the parts of the pieces it spans; the first error ends it.
template <typename Send>
absl::Status ForEachFrame(FrameParts pieces, uint64_t frame_bytes, Send send) {
  std::vector<absl::Span<const uint8_t>> frame;
  uint64_t bytes = 0;
  for (absl::Span<const uint8_t> piece : pieces) {
    while (!piece.empty()) {
      const uint64_t taken = std::min<uint64_t>(piece.size(), frame_bytes - bytes);
      frame.push_back(piece.first(taken));
      bytes += taken;
      piece.remove_prefix(taken);
      if (bytes == frame_bytes) {
        if (absl::Status status = send(FrameParts(frame), bytes); !status.ok()) return status;
        frame.clear();
        bytes = 0;
      }
    }
  }
  if (bytes > 0) return send(FrameParts(frame), bytes);
  return absl::OkStatus();
}

// The slot a fetched frame or a refusal names.
FetchKey KeyOf(const FrameHeader& header) {
  return header.kind == FrameKind::kFetchedUnit
             ? FetchKey{header.step, header.stripe, header.stripe_unit, header.rank, "",
                        header.attempt}
             : FetchKey{header.step, 0, 0, header.rank, header.region, header.attempt};
}

// The header of a frame of `kind` answering the region request `request`: its step, rank, region
// and request token.
FrameHeader AnswerTo(const FrameHeader& request, FrameKind kind) {
  FrameHeader answer;
  answer.kind = kind;
  answer.step = request.step;
  answer.rank = request.rank;
  answer.region = request.region;
  answer.attempt = request.attempt;
  return answer;
}

// Whether a changed unit of `stripe` goes as its delta against the committed step: it does
// unless its stripe is encoded afresh (every unit of it changed).
bool SentAsDelta(const StepChanges& changes, uint64_t stripe) { return !changes.Fresh(stripe); }

}  // namespace

std::string FetchKey::Describe() const {
  return region.empty() ? absl::StrCat("unit ", unit, " of stripe ", stripe, ", step ", step,
                                       " from node ", rank)
                        : absl::StrCat("region '", region, "' of rank ", rank, ", step ", step);
}

Transfer::Transfer(const ClusterContext& context, const ClusterStore* store, ParityStore* parity)
    : context_(context),
      store_(store),
      parity_(parity),
      requests_issued_(absl::ToUnixMicros(absl::Now())),
      region_requests_(std::make_unique<PeerRequests>(
          kRegionServingThreads, kRegionThreadsPerPeer, kRegionRequestsQueuedPerPeer)) {}

Transfer::~Transfer() {
  server_.reset();  // no more requests come in
  stopping_ = true;  // a request being served sends no more of its regions
  region_requests_.reset();
}

absl::StatusOr<uint16_t> Transfer::Start(const std::string& host, uint16_t port) {
  absl::StatusOr<std::unique_ptr<DataPlaneServer>> server =
      DataPlaneServer::Start({.host = host,
                              .port = port,
                              .max_payload_bytes = kMaxFrameBytes,
                              .max_connections = context_.options().max_data_connections,
                              .tls = context_.tls},
                             this);
  if (!server.ok()) return server.status();
  server_ = *std::move(server);
  return server_->port();
}

absl::StatusOr<std::shared_ptr<DataPlaneClient>> Transfer::Client(uint32_t id) {
  const uint64_t incarnation = context_.nodes->Incarnation(id);
  {
    absl::MutexLock lock(&connections_mutex_);
    if (auto it = connections_.find(id);
        it != connections_.end() && it->second.incarnation == incarnation) {
      return it->second.client;
    }
  }
  // Connect outside the lock, so a slow peer delays only the callers that send to it.
  const std::optional<ClusterNode> node = context_.nodes->Address(id);
  if (!node) {
    return absl::UnavailableError(absl::StrCat("node ", id, " is lost (no daemon holds it)"));
  }
  absl::StatusOr<std::unique_ptr<DataPlaneClient>> connected =
      DataPlaneClient::Connect(node->host, node->data_port, kDataConnectionsPerPeer,
                               kDataSendTimeout, {context_.tls, id});
  if (!connected.ok()) {
    return absl::UnavailableError(absl::StrCat("data plane of node ", id, ": ",
                                               connected.status().message()));
  }
  Log(LogLevel::kDebug, "data plane: connected to node ", id);
  absl::MutexLock lock(&connections_mutex_);
  // Another sender may have connected meanwhile: one client per incarnation, the first one kept.
  Connection& connection = connections_[id];
  if (connection.client == nullptr || connection.incarnation != incarnation) {
    connection = {incarnation, *std::move(connected)};
  }
  return connection.client;
}

absl::Status Transfer::SendFrames(absl::Span<const uint32_t> to, FrameHeader header,
                                  absl::Span<const absl::Span<const uint8_t>> pieces) {
  std::vector<std::shared_ptr<DataPlaneClient>> clients;
  for (uint32_t node : to) {
    absl::StatusOr<std::shared_ptr<DataPlaneClient>> client = Client(node);
    if (!client.ok()) return client.status();
    clients.push_back(*std::move(client));
  }
  return ForEachFrame(pieces, kFrameBytes, [&](FrameParts frame, uint64_t bytes) -> absl::Status {
    if (absl::Status sealed = SealFrame(header, frame); !sealed.ok()) return sealed;
    for (size_t i = 0; i < clients.size(); ++i) {
      if (absl::Status status = clients[i]->SendSealed(header, frame); !status.ok()) {
        return absl::UnavailableError(absl::StrCat("sending stripe ", header.stripe, " to node ",
                                                   to[i], ": ", status.message()));
      }
    }
    header.offset += bytes;
    return absl::OkStatus();
  });
}

absl::Status Transfer::SendChunks(uint32_t to, FrameHeader header,
                                  absl::Span<const absl::Span<const uint8_t>> pieces,
                                  uint64_t chunk_bytes, absl::Span<const uint32_t> chunk_crcs) {
  uint64_t total = 0;
  for (absl::Span<const uint8_t> piece : pieces) total += piece.size();
  if (chunk_bytes == 0 || chunk_bytes > kMaxFrameBytes ||
      chunk_crcs.size() != total / chunk_bytes + (total % chunk_bytes != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        total, " bytes in chunks of ", chunk_bytes, " with ", chunk_crcs.size(),
        " CRCs do not go as frames of one chunk each (at most ", kMaxFrameBytes, " bytes)"));
  }
  absl::StatusOr<std::shared_ptr<DataPlaneClient>> client = Client(to);
  if (!client.ok()) return client.status();
  size_t chunk = 0;
  return ForEachFrame(pieces, chunk_bytes, [&](FrameParts frame, uint64_t bytes) -> absl::Status {
    header.length = static_cast<uint32_t>(bytes);  // at most kMaxFrameBytes
    header.payload_crc = chunk_crcs[chunk++];
    if (absl::Status status = (*client)->SendSealed(header, frame); !status.ok()) {
      return absl::UnavailableError(
          absl::StrCat("sending ",
                       header.region.empty() ? absl::StrCat("stripe ", header.stripe)
                                             : absl::StrCat("region '", header.region, "'"),
                       " to node ", to, ": ", status.message()));
    }
    header.offset += bytes;
    return absl::OkStatus();
  });
}

std::vector<int> Transfer::DeltaRegions(const NodeImage& image, const StepChanges& changes) const {
  const erasure::StripeLayout& layout = context_.layout();
  const int position = context_.topology->position;
  std::vector<int> regions;
  const uint64_t units = layout.UnitCount(image.bytes());
  for (uint64_t unit = 0; unit < units; ++unit) {
    if (!changes.Changed(position, unit) ||
        !SentAsDelta(changes, layout.DataUnitLocation(position, unit).stripe)) {
      continue;
    }
    for (int region : image.RegionsIn(unit * layout.unit_bytes(),
                                      layout.UnitLength(image.bytes(), unit))) {
      // Units come in order, so a region two units share comes last from the first.
      if (regions.empty() || regions.back() < region) regions.push_back(region);
    }
  }
  return regions;
}

absl::StatusOr<uint64_t> Transfer::SendDataUnits(
    int64_t step, int64_t attempt, const NodeImage& image,
    const std::vector<std::shared_ptr<PoolBytes>>* committed, const StepChanges* changes,
    const std::set<uint32_t>& absent) {
  if (committed != nullptr &&
      committed->size() != static_cast<size_t>(image.manifest().regions_size())) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step, ": ", committed->size(),
                                                   " committed regions for an image of ",
                                                   image.manifest().regions_size()));
  }
  if (committed != nullptr) {
    if (changes == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", step, ": committed bytes come with the changes they are for"));
    }
    for (int region : DeltaRegions(image, *changes)) {
      if ((*committed)[region] == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "step ", step, ": no committed bytes of region ", region, " for its delta"));
      }
    }
  }
  const erasure::StripeLayout& layout = context_.layout();
  const int position = context_.topology->position;
  // Each unit's delta is computed once, and each of its frames checksummed once, for all of its
  // parity holders. The units are dealt out to as many threads as there are holders, so that
  // holders fill in parallel.
  struct UnitSend {
    uint64_t unit = 0;
    std::vector<uint32_t> holders;
  };
  std::vector<UnitSend> sends;
  std::set<uint32_t> holders;
  const uint64_t units = layout.UnitCount(image.bytes());
  for (uint64_t unit = 0; unit < units; ++unit) {
    if (changes != nullptr && !changes->Changed(position, unit)) continue;
    const erasure::UnitLocation location = layout.DataUnitLocation(position, unit);
    UnitSend send{unit, {}};
    for (int holder : layout.Members(location.stripe).parity_positions) {
      const uint32_t node = context_.topology->NodeAt(holder);
      if (absent.contains(node)) continue;
      send.holders.push_back(node);
      holders.insert(node);
    }
    if (!send.holders.empty()) sends.push_back(std::move(send));
  }
  std::vector<size_t> workers(std::min(holders.size(), sends.size()));
  std::iota(workers.begin(), workers.end(), 0);
  std::atomic<uint64_t> sent{0};
  std::vector<absl::Status> statuses = InParallel(workers, [&](size_t worker) -> absl::Status {
    // A unit sent as itself (a full encode's, or a fresh stripe's) goes from where it lies. A
    // delta (old XOR new) is computed a frame at a time into one buffer that stays in cache while
    // the frame is checksummed and sent.
    std::unique_ptr<uint8_t[]> delta;
    for (size_t i = worker; i < sends.size(); i += workers.size()) {
      const uint64_t unit = sends[i].unit;
      const erasure::UnitLocation location = layout.DataUnitLocation(position, unit);
      const uint64_t length = layout.UnitLength(image.bytes(), unit);
      FrameHeader header;
      header.kind = FrameKind::kParityDelta;
      header.step = step;
      header.attempt = attempt;
      header.rank = context_.node_id();
      header.stripe = location.stripe;
      header.stripe_unit = static_cast<uint32_t>(location.index);
      const uint64_t start = unit * layout.unit_bytes();
      if (committed != nullptr && SentAsDelta(*changes, location.stripe)) {
        if (delta == nullptr) delta = std::make_unique_for_overwrite<uint8_t[]>(kFrameBytes);
        for (uint64_t offset = 0; offset < length; offset += kFrameBytes) {
          const uint64_t bytes = std::min<uint64_t>(kFrameBytes, length - offset);
          image.XorWith(*committed, start + offset, bytes, delta.get());
          header.offset = offset;
          if (absl::Status status = SendFrames(sends[i].holders, header, delta.get(), bytes);
              !status.ok()) {
            return status;
          }
        }
      } else if (absl::Status status =
                     SendFrames(sends[i].holders, header, image.Spans(start, length));
                 !status.ok()) {
        return status;
      }
      sent += length * sends[i].holders.size();
    }
    return absl::OkStatus();
  });
  for (const absl::Status& status : statuses) {
    if (!status.ok()) return status;
  }
  return sent.load();
}

absl::StatusOr<v1::SendUnitsResponse> Transfer::ServeUnits(const v1::SendUnitsRequest& request) {
  const erasure::StripeLayout& layout = context_.layout();
  const uint32_t self = context_.node_id();
  const std::shared_ptr<const v1::JournalCluster> committed = store_->ClusterRecord();
  const v1::JournalCluster& record = *committed;
  if (!record.has_committed_step() || record.committed_step() != request.step()) {
    return absl::FailedPreconditionError(
        absl::StrCat("node ", self, " does not hold step ", request.step()));
  }
  // Each unit once, of a stripe the committed step has: a request costs at most one copy of what
  // this node holds.
  std::vector<uint64_t> sizes;
  for (const v1::NodeImage& member : record.group_images()) sizes.push_back(member.bytes());
  const uint64_t stripes = layout.StripeCount(sizes);
  std::set<std::pair<uint64_t, uint32_t>> asked;
  for (const v1::UnitRef& ref : request.units()) {
    if (ref.stripe() >= stripes || !asked.insert({ref.stripe(), ref.unit()}).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unit ", ref.unit(), " of stripe ", ref.stripe(),
          ref.stripe() >= stripes ? absl::StrCat(": step ", request.step(), " has ", stripes,
                                                 " stripes")
                                  : " is asked for twice"));
    }
  }
  std::vector<std::pair<uint64_t, uint32_t>> refs;
  for (const v1::UnitRef& ref : request.units()) refs.emplace_back(ref.stripe(), ref.unit());
  absl::StatusOr<HeldUnits> held = HoldOwnUnits(request.step(), refs);
  if (!held.ok()) return held.status();
  v1::SendUnitsResponse response;
  std::vector<uint32_t> frame_crcs;
  for (size_t i = 0; i < refs.size(); ++i) {
    FrameHeader header;
    header.kind = FrameKind::kFetchedUnit;
    header.step = request.step();
    header.rank = self;
    header.stripe = refs[i].first;
    header.stripe_unit = refs[i].second;
    header.attempt = request.request();
    const std::vector<absl::Span<const uint8_t>>& spans = held->spans[i];
    uint64_t bytes = 0;
    for (absl::Span<const uint8_t> span : spans) bytes += span.size();
    // A parity unit is checked against its stored CRC-32C before any of it goes, in the pass that
    // checksums its frames.
    absl::Status sent;
    if (held->parity_crcs[i] && bytes > 0) {
      if (absl::Status checked = held->CheckParity(i, kFrameBytes, &frame_crcs); !checked.ok()) {
        return absl::Status(checked.code(), absl::StrCat("node ", self, ": ", checked.message()));
      }
      sent = SendChunks(request.to_node(), header, spans, kFrameBytes, frame_crcs);
    } else {
      sent = SendFrames(request.to_node(), header, spans);
    }
    if (!sent.ok()) return sent;
    response.set_bytes(response.bytes() + bytes);
  }
  return response;
}

absl::StatusOr<Transfer::HeldUnits> Transfer::HoldOwnUnits(
    int64_t step, const std::vector<std::pair<uint64_t, uint32_t>>& refs) const {
  auto not_held = [&](absl::string_view while_reading) {
    return absl::FailedPreconditionError(absl::StrCat("node ", context_.node_id(), while_reading,
                                                      " step ", step));
  };
  if (const std::shared_ptr<const v1::JournalCluster> record = store_->ClusterRecord();
      !record->has_committed_step() || record->committed_step() != step) {
    return not_held(" does not hold");
  }
  // Steps commit while a peer rebuilds (it is absent from them): what is read must be all of one
  // step. The image and parity units are held before the record is looked at again; committed
  // units are never written, so they stay the step's while held.
  const erasure::StripeLayout& layout = context_.layout();
  HeldUnits held{refs, store_->CommittedImage(), {}, {}, {}};
  for (const auto& [stripe, unit] : refs) {
    absl::StatusOr<OwnUnit> own = FindOwnUnit(step, stripe, unit);
    if (!own.ok()) return own.status();
    if (own->parity) {
      held.spans.push_back({{own->parity->extent->data(), own->parity->bytes}});
      held.parity_crcs.push_back(own->parity->crc);
      held.extents.push_back(std::move(own->parity->extent));
    } else {
      held.spans.push_back(held.image.Spans(own->data_unit * layout.unit_bytes(),
                                            layout.UnitLength(held.image.bytes(), own->data_unit)));
      held.parity_crcs.push_back(std::nullopt);
    }
  }
  if (const std::shared_ptr<const v1::JournalCluster> now = store_->ClusterRecord();
      !now->has_committed_step() || now->committed_step() != step) {
    return not_held(" committed another step while reading units of");
  }
  return held;
}

absl::Status Transfer::HeldUnits::CheckParity(size_t i, uint64_t frame_bytes,
                                              std::vector<uint32_t>* frame_crcs) const {
  if (!parity_crcs[i]) return absl::OkStatus();
  const absl::Span<const uint8_t> unit = spans[i][0];
  uint32_t crc = 0;
  if (frame_crcs == nullptr) {
    crc = erasure::Crc32c(unit.data(), unit.size());
  } else {
    frame_crcs->clear();
    for (uint64_t offset = 0; offset < unit.size(); offset += frame_bytes) {
      const uint64_t bytes = std::min<uint64_t>(frame_bytes, unit.size() - offset);
      frame_crcs->push_back(erasure::Crc32c(unit.data() + offset, bytes));
      crc = erasure::Crc32cCombine(crc, frame_crcs->back(), bytes);
    }
  }
  if (crc != *parity_crcs[i]) {
    return absl::DataLossError(absl::StrCat("parity of stripe ", refs[i].first,
                                            " fails its CRC-32C (moesnapctl verify --repair)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Transfer::OwnUnit> Transfer::FindOwnUnit(int64_t step, uint64_t stripe,
                                                        uint32_t unit) const {
  const erasure::StripeLayout& layout = context_.layout();
  const int position = context_.topology->position;
  const uint32_t self = context_.node_id();
  const erasure::StripeMembers members = layout.Members(stripe);
  const uint32_t k = static_cast<uint32_t>(layout.data_units());
  OwnUnit own;
  if (unit < k && members.data_positions[unit] == position) {
    own.data_unit = layout.DataUnitOf(position, stripe);
    return own;
  }
  if (unit >= k && unit < static_cast<uint32_t>(layout.group_size()) &&
      members.parity_positions[unit - k] == position) {
    own.parity = parity_->CommittedOf(step, stripe);
    if (!own.parity) {
      return absl::NotFoundError(
          absl::StrCat("node ", self, " holds no parity of stripe ", stripe, " of step ", step));
    }
    return own;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("node ", self, " holds no unit ", unit, " of stripe ", stripe));
}

absl::Status Transfer::Expect(const std::vector<std::pair<FetchKey, FetchSlot>>& slots) {
  absl::MutexLock lock(&fetch_mutex_);
  for (const auto& [key, slot] : slots) {
    if (fetches_.contains(key)) {
      return absl::UnavailableError(
          absl::StrCat(key.Describe(), " is awaited by another decode on this node already"));
    }
  }
  for (auto it = slots.begin(); it != slots.end(); ++it) {
    auto [entry, added] = fetches_.try_emplace(it->first);
    if (!added) {  // named twice in `slots`: one slot would never be filled
      for (auto before = slots.begin(); before != it; ++before) fetches_.erase(before->first);
      return absl::InvalidArgumentError(
          absl::StrCat(it->first.Describe(), " is expected twice in one fetch"));
    }
    entry->second.slot = it->second;
    entry->second.missing = it->second.bytes;
  }
  return absl::OkStatus();
}

absl::Status Transfer::Collect(const std::vector<FetchKey>& keys, absl::Status sent) {
  absl::MutexLock lock(&fetch_mutex_);
  // The first failure of any of the keys, before or while waiting, ends the wait.
  uint64_t failures_seen = fetch_failures_;
  auto first_failure = [&]() -> absl::Status {
    fetch_mutex_.AssertReaderHeld();
    for (const FetchKey& key : keys) {
      const Awaited& awaited = fetches_[key];
      if (!awaited.failure.empty()) {
        return absl::Status(awaited.failure_code,
                            absl::StrCat(key.Describe(), ": ", awaited.failure));
      }
    }
    return absl::OkStatus();
  };
  if (sent.ok()) sent = first_failure();
  // Last key first: a fetch's frames mostly come in the order its keys were asked for, so this
  // thread is woken once for the keys that came before, not once a frame (a wake-up costs more
  // than the frame of a small region).
  for (auto key = keys.rbegin(); key != keys.rend() && sent.ok(); ++key) {
    // The wait ends when no byte of the key came for kFetchWait (a large region takes longer),
    // and in any case once it took kFetchWait more than at kSlowestFetch bytes per second.
    const Awaited& awaited = fetches_[*key];
    uint64_t missing = awaited.missing;
    const absl::Time start = absl::Now();
    const absl::Time ceiling =
        start + kFetchWait + absl::Seconds(static_cast<double>(missing) / kSlowestFetch);
    absl::Time deadline = start + kFetchWait;
    auto progressed = [&]() {
      fetch_mutex_.AssertReaderHeld();
      return awaited.missing < missing || fetch_failures_ != failures_seen;
    };
    while (sent.ok()) {
      const absl::Time now = absl::Now();
      if (fetch_failures_ != failures_seen) {
        failures_seen = fetch_failures_;
        sent = first_failure();
      } else if (awaited.missing == 0) {
        break;
      } else if (awaited.missing < missing) {
        missing = awaited.missing;
        deadline = std::min(now + kFetchWait, ceiling);
      } else if (now >= deadline) {
        sent = absl::DeadlineExceededError(absl::StrCat(key->Describe(), " did not arrive"));
      } else if (!context_.nodes->Live(awaited.slot.source)) {
        sent = absl::UnavailableError(absl::StrCat(key->Describe(), ": node ",
                                                   awaited.slot.source,
                                                   " was lost before sending it"));
      } else {
        fetch_mutex_.AwaitWithTimeout(absl::Condition(&progressed),
                                      std::min(kSenderCheckInterval, deadline - now));
      }
    }
  }
  // No frame starts into the caller's buffers from now on; one still being read in ends within
  // the data plane's frame timeout.
  for (const FetchKey& key : keys) fetches_[key].closed = true;
  for (const FetchKey& key : keys) {
    while (fetches_[key].writers > 0) fetched_.Wait(&fetch_mutex_);
  }
  for (const FetchKey& key : keys) fetches_.erase(key);
  return sent;
}

std::pair<size_t, uint64_t> Transfer::FetchesWaiting() {
  absl::MutexLock lock(&fetch_mutex_);
  uint64_t missing = 0;
  for (const auto& [key, awaited] : fetches_) missing += awaited.missing;
  return {fetches_.size(), missing};
}

absl::StatusOr<std::optional<FrameSink::InPlace>> Transfer::Reserve(
    const FrameHeader& header, std::optional<uint32_t> sender) {
  if (header.kind != FrameKind::kFetchedUnit && header.kind != FrameKind::kFetchedRegion) {
    return std::nullopt;  // Accept takes it from the connection's buffer
  }
  const FetchKey key = KeyOf(header);
  absl::MutexLock lock(&fetch_mutex_);
  auto it = fetches_.find(key);
  if (it == fetches_.end() || it->second.closed) {
    // An answer that came after its fetch ended (it failed, or was given up): read and dropped,
    // unchecked (the holder's stored chunk may be damaged; no one uses it now).
    if (AnswersARequestMadeHere(header)) {
      Log(LogLevel::kDebug, "data plane: ", key.Describe(), " came after its fetch");
      return InPlace{.bytes = {}, .owner_checks = false, .drop = true};
    }
    return absl::InvalidArgumentError(absl::StrCat(
        key.Describe(), it == fetches_.end() ? " was not asked for" : " is no longer awaited"));
  }
  Awaited& awaited = it->second;
  const FetchSlot& slot = awaited.slot;
  if (sender && *sender != slot.source) {
    return absl::PermissionDeniedError(absl::StrCat(key.Describe(), " came from node ", *sender,
                                                    ", not from node ", slot.source, ", asked for it"));
  }
  if (!awaited.failure.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(key.Describe(), " failed already"));
  }
  // Bounds from the wire, checked without overflow: the offset may be anything. Frames within the
  // slot that overlap none before them (below) never bring more bytes than it misses.
  if (header.offset > slot.bytes || header.length > slot.bytes - header.offset) {
    return absl::InvalidArgumentError(absl::StrCat(key.Describe(), ": more bytes than asked for"));
  }
  // Each byte once: frames that overlap would leave others unwritten yet count them arrived.
  const uint64_t end = header.offset + header.length;
  if (header.length > 0) {
    auto next = awaited.taken.lower_bound(header.offset);
    if ((next != awaited.taken.end() && next->first < end) ||
        (next != awaited.taken.begin() && std::prev(next)->second > header.offset)) {
      return absl::InvalidArgumentError(absl::StrCat(key.Describe(), ": bytes [", header.offset,
                                                     ", ", end, ") came in another frame already"));
    }
    awaited.taken.emplace(header.offset, end);
  }
  ++awaited.writers;
  return InPlace{absl::Span<uint8_t>(slot.buffer + header.offset, header.length),
                 slot.owner_checks};
}

void Transfer::Filled(const FrameHeader& header, const absl::Status& checked) {
  absl::MutexLock lock(&fetch_mutex_);
  auto it = fetches_.find(KeyOf(header));
  if (it == fetches_.end()) {  // never: Collect keeps the slot while frames are read in
    Log(LogLevel::kError, "data plane: ", KeyOf(header).Describe(),
        " was filled after its fetch was collected");
    return;
  }
  Awaited& awaited = it->second;
  --awaited.writers;
  if (checked.ok()) {
    awaited.missing -= header.length;
  } else if (awaited.failure.empty()) {
    awaited.failure = std::string(checked.message());
    awaited.failure_code = absl::StatusCode::kDataLoss;
    ++fetch_failures_;
  }
  fetched_.SignalAll();
}

absl::Status Transfer::Accept(const FrameHeader& header, absl::Span<const uint8_t> payload,
                              std::optional<uint32_t> sender) {
  switch (header.kind) {
    case FrameKind::kParityDelta:
      return AcceptParityDelta(header, payload, sender);
    case FrameKind::kRegionRequest:
      return AcceptRegionRequest(header, payload, sender);
    case FrameKind::kRegionRefused:
      return AcceptRefusal(header, payload, sender);
    case FrameKind::kFetchedUnit:
    case FrameKind::kFetchedRegion:
      break;
  }
  return absl::InvalidArgumentError("a fetched frame is read into its slot, not accepted");
}

void Transfer::ConnectionClosed(std::optional<uint32_t> sender, const std::string& address,
                                const absl::Status& why) {
  // On plaintext, the nodes advertised at the peer's address (a node advertised by host name, or
  // reached through another address, is not matched: its fetches wait as before).
  std::map<uint32_t, bool> at_address;
  auto sent_by_peer = [&](uint32_t source) {
    if (sender) return *sender == source;
    auto [it, added] = at_address.try_emplace(source, false);
    if (added) {
      const std::optional<ClusterNode> node = context_.nodes->Address(source);
      it->second = node && node->host == address;
    }
    return it->second;
  };
  // Parity deltas come from the group's members only: a member's lost deltas fail the steps
  // still waiting for its data.
  const Topology& topology = *context_.topology;
  const std::vector<uint32_t>& group = topology.groups[topology.group];
  std::vector<int> members;  // the positions in the group of the nodes the connection was from
  for (size_t position = 0; position < group.size(); ++position) {
    if (group[position] != context_.node_id() && sent_by_peer(group[position])) {
      members.push_back(static_cast<int>(position));
    }
  }
  // From where and why.
  const std::string lost = absl::StrCat(sender ? absl::StrCat("node ", *sender, " at ") : "",
                                        address.empty() ? "a peer" : address, ": ",
                                        why.ToString());
  const std::string closed = absl::StrCat("this node closed a data-plane connection from ", lost);
  if (!members.empty()) {
    parity_->FailIncomplete(members, absl::StrCat("a member's deltas may be lost: ", closed));
  }
  absl::MutexLock lock(&fetch_mutex_);
  bool failed = false;
  ++connections_closed_;
  last_connection_closed_ = lost;
  for (auto& [key, awaited] : fetches_) {
    if (awaited.closed || awaited.missing == 0 || !awaited.failure.empty() ||
        !sent_by_peer(awaited.slot.source)) {
      continue;
    }
    awaited.failure = absl::StrCat("node ", awaited.slot.source, "'s frames may be lost: ", closed);
    awaited.failure_code = absl::StatusCode::kUnavailable;
    failed = true;
  }
  if (failed) ++fetch_failures_;
}

bool Transfer::AnswersARequestMadeHere(const FrameHeader& header) const {
  return (header.kind == FrameKind::kFetchedUnit || header.kind == FrameKind::kFetchedRegion ||
          header.kind == FrameKind::kRegionRefused) &&
         header.attempt > 0 && header.attempt <= requests_issued_.load();
}

absl::Status Transfer::AcceptParityDelta(const FrameHeader& header,
                                         absl::Span<const uint8_t> payload,
                                         std::optional<uint32_t> sender) {
  if (sender) {
    const erasure::StripeLayout& layout = context_.layout();
    if (header.stripe_unit >= static_cast<uint32_t>(layout.data_units())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "node ", *sender, " sent a parity delta of data unit ", header.stripe_unit,
          "; a stripe has ", layout.data_units()));
    }
    const uint32_t owner = context_.topology->NodeAt(
        layout.Members(header.stripe).data_positions[header.stripe_unit]);
    if (owner != *sender) {
      return absl::PermissionDeniedError(absl::StrCat(
          "node ", *sender, " sent a parity delta of node ", owner, "'s data unit ",
          header.stripe_unit, " of stripe ", header.stripe, " (step ", header.step, ")"));
    }
  }
  return parity_->Accept(header, payload);
}

absl::Status Transfer::RequestRegions(uint32_t holder, int64_t step, uint32_t rank,
                                      absl::Span<const absl::string_view> regions,
                                      int64_t request) {
  absl::StatusOr<std::vector<uint8_t>> payload = EncodeRegionRequest(context_.node_id(), regions);
  if (!payload.ok()) return payload.status();
  absl::StatusOr<std::shared_ptr<DataPlaneClient>> client = Client(holder);
  if (!client.ok()) return client.status();
  FrameHeader header;
  header.kind = FrameKind::kRegionRequest;
  header.step = step;
  header.rank = rank;
  header.attempt = request;
  if (absl::Status sent = (*client)->Send(std::move(header), absl::Span<const uint8_t>(*payload));
      !sent.ok()) {
    return absl::UnavailableError(absl::StrCat("asking node ", holder, " for ", regions.size(),
                                               " regions of rank ", rank, ": ", sent.message()));
  }
  return absl::OkStatus();
}

absl::Status Transfer::AcceptRegionRequest(const FrameHeader& header,
                                           absl::Span<const uint8_t> payload,
                                           std::optional<uint32_t> sender) {
  if (!header.region.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a region request names its regions in its payload, not '", header.region, "'"));
  }
  absl::StatusOr<RegionRequest> request = DecodeRegionRequest(payload);
  if (!request.ok()) return request.status();
  const uint32_t asking = request->asking;
  if (sender && *sender != asking) {
    return absl::PermissionDeniedError(absl::StrCat("node ", *sender, " asked for regions of rank ",
                                                    header.rank, " to be sent to node ", asking));
  }
  if (!context_.options().GroupOf(asking)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a region request asks for an answer to node ", asking,
                     ", which is not in the cluster"));
  }
  // Beyond its share, a node's requests are refused (queued still, but answered without a pass
  // over the store): an honest node keeps fewer in flight, yet may leave some behind that a fetch
  // it gave up on made.
  return region_requests_->Add(
      asking, [this, asking, header, regions = std::move(request->regions)](int ahead) {
        // What the regions of a request naming several may still hold together.
        uint64_t room = regions.size() > 1 ? RegionRequest::kMaxBytes
                                           : std::numeric_limits<uint64_t>::max();
        for (const std::string& region : regions) {
          if (stopping_) return;
          FrameHeader asked = header;
          asked.region = region;
          if (!ServeRegion(asking, asked, /*busy=*/ahead >= kRegionRequestsPerPeer, &room)) return;
        }
      });
}

bool Transfer::ServeRegion(uint32_t to, const FrameHeader& request, bool busy, uint64_t* room) {
  const absl::Status sent =
      busy ? absl::ResourceExhaustedError(absl::StrCat("node ", to, " has ",
                                                       kRegionRequestsPerPeer,
                                                       " region requests at node ",
                                                       context_.node_id(), " already"))
           : SendRegion(to, request, room);
  if (sent.ok()) return true;
  FrameHeader refusal = AnswerTo(request, FrameKind::kRegionRefused);
  const absl::string_view why = sent.message().substr(0, kMaxRefusalBytes);
  absl::StatusOr<std::shared_ptr<DataPlaneClient>> client = Client(to);
  const absl::Status told =
      client.ok() ? (*client)->Send(std::move(refusal),
                                    {reinterpret_cast<const uint8_t*>(why.data()), why.size()})
                  : client.status();
  if (told.ok()) return true;
  // The node stopped reading (or is gone): the rest of this request and its other requests are
  // dropped rather than each holding a thread until its send times out.
  const int dropped = region_requests_->Forget(to);
  Log(LogLevel::kWarning, "data plane: could not tell node ", to, " why region '", request.region,
      "' of rank ", request.rank, " was not sent (", sent.ToString(), "): ", told.ToString(),
      "; the rest of its request and its ", dropped, " other queued requests are dropped");
  return false;
}

absl::Status Transfer::SendRegion(uint32_t to, const FrameHeader& request, uint64_t* room) {
  // Found by name, not in the whole committed image: a rank of thousands of regions restored
  // elsewhere asks for each.
  absl::StatusOr<ClusterStore::HeldRegion> held =
      store_->CommittedRegion(request.step, request.rank, request.region);
  if (absl::IsFailedPrecondition(held.status())) {
    return absl::FailedPreconditionError(
        absl::StrCat("node ", context_.node_id(), " does not hold step ", request.step));
  }
  if (!held.ok()) {
    return absl::NotFoundError(absl::StrCat("node ", context_.node_id(), " holds no region '",
                                            request.region, "' of rank ", request.rank));
  }
  const v1::ImageRegion& region = held->record;
  if (region.bytes() > *room) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "region '", request.region, "' (", region.bytes(), " bytes) would take its request past ",
        RegionRequest::kMaxBytes, " bytes of regions"));
  }
  *room -= region.bytes();
  const FrameHeader header = AnswerTo(request, FrameKind::kFetchedRegion);
  std::vector<absl::Span<const uint8_t>> spans;
  held->stored->ForEach(0, region.bytes(), [&](const uint8_t* data, uint64_t bytes, uint64_t) {
    spans.emplace_back(data, bytes);
  });
  // A chunk that fits a frame goes as one, with its stored CRC-32C: the restoring node checks the
  // bytes against the same CRCs as it writes them into the rank (WriteRegion).
  return region.chunk_bytes() <= kMaxFrameBytes
             ? SendChunks(to, header, spans, region.chunk_bytes(), region.chunk_crcs())
             : SendFrames(to, header, spans);
}

absl::Status Transfer::AcceptRefusal(const FrameHeader& header, absl::Span<const uint8_t> payload,
                                     std::optional<uint32_t> sender) {
  if (payload.size() > kMaxRefusalBytes || header.region.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a refusal names a region and says why in at most ", kMaxRefusalBytes, " bytes, not '",
        header.region, "' and ", payload.size(), " bytes"));
  }
  const FetchKey key = KeyOf(header);
  absl::MutexLock lock(&fetch_mutex_);
  auto it = fetches_.find(key);
  if (it == fetches_.end() || it->second.closed) {
    if (!AnswersARequestMadeHere(header)) {
      return absl::InvalidArgumentError(
          absl::StrCat("a refusal of ", key.Describe(), ", which this node did not ask for"));
    }
    // The fetch ended before the answer came (it timed out, or another region of it failed).
    Log(LogLevel::kDebug, "data plane: a refusal of ", key.Describe(), " came after its fetch");
    return absl::OkStatus();
  }
  Awaited& awaited = it->second;
  if (sender && *sender != awaited.slot.source) {
    return absl::PermissionDeniedError(absl::StrCat("node ", *sender, " refused ", key.Describe(),
                                                    ", asked of node ", awaited.slot.source));
  }
  if (awaited.failure.empty()) {
    // The peer's words go into logs and errors: bytes outside printable ASCII become '?'.
    std::string why(payload.begin(), payload.end());
    for (char& c : why) {
      if (c < ' ' || c > '~') c = '?';
    }
    awaited.failure = absl::StrCat("node ", awaited.slot.source, " refused it: ", why);
    awaited.failure_code = absl::StatusCode::kFailedPrecondition;
    ++fetch_failures_;
  }
  return absl::OkStatus();
}

}  // namespace moesnap::daemon::cluster
