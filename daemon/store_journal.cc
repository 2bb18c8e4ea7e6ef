// Store: its journal writes, the state as pieces, most of them serialized before (the group
// record's images as their participant serialized them, each version's entry as its first write
// made it).
#include "daemon/store.h"
#include "daemon/store_types.h"

#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/io/coded_stream.h"

namespace moesnap::daemon {
namespace {

// The tag and length that put `length` bytes of a message in field `field` of its parent.
std::string MessageFieldHeader(int field, uint64_t length) {
  using google::protobuf::io::CodedOutputStream;
  constexpr uint32_t kLengthDelimited = 2;  // the wire type of a message field
  constexpr int kMaxVarintBytes = 10;       // of a 64-bit varint
  uint8_t header[2 * kMaxVarintBytes];
  uint8_t* end = CodedOutputStream::WriteVarint32ToArray(
      static_cast<uint32_t>(field) << 3 | kLengthDelimited, header);
  end = CodedOutputStream::WriteVarint64ToArray(length, end);
  return std::string(reinterpret_cast<const char*>(header), end - header);
}

}  // namespace

std::vector<std::string> SerializedImages(const v1::JournalCluster& cluster) {
  std::vector<std::string> bytes;
  for (const v1::NodeImage& image : cluster.group_images()) {
    bytes.push_back(image.SerializeAsString());
  }
  return bytes;
}

const std::string& Store::JournalFieldOf(const Version& version, v1::JournalVersion& scratch) {
  if (!version.journal_field.empty()) return version.journal_field;
  scratch.Clear();
  version.Save(&scratch);
  for (const std::shared_ptr<PoolExtent>& extent : version.stored->extents()) {
    v1::PoolSpan* span = scratch.add_extents();
    span->set_offset(extent->offset());
    span->set_bytes(extent->bytes());
  }
  const size_t entry_bytes = scratch.ByteSizeLong();
  const std::string header =
      MessageFieldHeader(v1::JournalState::kVersionsFieldNumber, entry_bytes);
  std::string& field = version.journal_field;
  field.resize(header.size() + entry_bytes);
  std::memcpy(field.data(), header.data(), header.size());
  scratch.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(field.data()) + header.size());
  return field;
}

absl::Status Store::WriteJournal(const std::map<uint32_t, const StepRecord*>& committing,
                                 const v1::JournalCluster& cluster,
                                 const std::vector<std::string>& image_bytes) const {
  if (image_bytes.size() != static_cast<size_t>(cluster.group_images_size())) {
    return absl::InvalidArgumentError(absl::StrCat(image_bytes.size(),
                                                   " serialized images for a group record of ",
                                                   cluster.group_images_size()));
  }
  google::protobuf::Arena arena;
  auto* state = google::protobuf::Arena::CreateMessage<v1::JournalState>(&arena);
  // Each version's entry is serialized at its first write and copied by every later one: a step
  // that changed a few of a rank's thousands of regions serializes those few.
  std::string versions;
  v1::JournalVersion& scratch =
      *google::protobuf::Arena::CreateMessage<v1::JournalVersion>(&arena);
  auto add = [&](const Version& version) { versions += JournalFieldOf(version, scratch); };
  for (const auto& [rank_id, rank_state] : ranks_) {
    const StepRecord* record = nullptr;
    if (auto it = committing.find(rank_id); it != committing.end()) record = it->second;
    ForEachVersionAfter(rank_state, record, add);
    if (std::optional<v1::JournalRank> saved = RankRecordAfter(rank_id, rank_state, record)) {
      *state->add_ranks() = *std::move(saved);
    }
  }
  // The cluster record lists every group member's image, region by region: the record follows
  // the versions and ranks as field 3 of the same state, its images as the bytes kept beside it
  // (fields of a message may come in any order, and a repeated field's keep theirs).
  v1::JournalCluster& head = *google::protobuf::Arena::CreateMessage<v1::JournalCluster>(&arena);
  if (cluster.has_committed_step()) head.set_committed_step(cluster.committed_step());
  *head.mutable_parity() = cluster.parity();
  const std::string ranks = state->SerializeAsString();
  const std::string head_bytes = head.SerializeAsString();
  constexpr int kClusterField = v1::JournalState::kClusterFieldNumber;
  constexpr int kImagesField = v1::JournalCluster::kGroupImagesFieldNumber;
  std::vector<std::string> image_headers;
  uint64_t cluster_bytes = head_bytes.size();
  for (const std::string& image : image_bytes) {
    image_headers.push_back(MessageFieldHeader(kImagesField, image.size()));
    cluster_bytes += image_headers.back().size() + image.size();
  }
  const std::string cluster_header = MessageFieldHeader(kClusterField, cluster_bytes);
  std::vector<std::string_view> payload = {versions, ranks, cluster_header, head_bytes};
  for (size_t i = 0; i < image_bytes.size(); ++i) {
    payload.push_back(image_headers[i]);
    payload.push_back(image_bytes[i]);
  }
  return journal_->Write(payload);
}

}  // namespace moesnap::daemon
