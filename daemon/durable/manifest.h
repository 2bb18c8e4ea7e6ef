// The manifest of a drained step (v1::DurableManifest) as the bytes of its file, and the checks a
// manifest read back from disk must pass before anything uses it. A manifest file is untrusted:
// a fixed header (magic, format version, payload length, CRC-32C of the payload) bounds and
// protects the payload, and every size and offset in it is checked, overflow-safe, against the
// data files it describes.
//
// Step folder layout: manifest.binpb, and rank-<R>.data per rank holding that rank's regions at
// kRegionAlignment-aligned offsets (the gaps are zero).
#ifndef MOESNAP_DAEMON_DURABLE_MANIFEST_H_
#define MOESNAP_DAEMON_DURABLE_MANIFEST_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::durable {

inline constexpr uint32_t kManifestFormatVersion = 1;
inline constexpr uint64_t kManifestHeaderBytes = 32;
// Larger than any real manifest (a region costs about a hundred bytes plus 4 per chunk).
inline constexpr uint64_t kMaxManifestPayloadBytes = uint64_t{64} << 20;
inline constexpr uint64_t kRegionAlignment = 4096;
// The chunk sizes a region record may claim (a reader holds a chunk in memory); its name, dtype,
// shape, chunk CRCs and piece are checked as any stored region's (CheckStoredRegion).
inline constexpr uint64_t kMinChunkBytes = 4096;
inline constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 30;

inline constexpr char kManifestFileName[] = "manifest.binpb";
std::string DataFileName(uint32_t rank);

// Header + serialized payload.
std::string SerializeManifestFile(const v1::DurableManifest& manifest);
// Checks the header and parses the payload; `origin` names the file in errors. The manifest is
// not checked against anything yet (CheckManifest).
absl::StatusOr<v1::DurableManifest> ParseManifestFile(absl::string_view bytes,
                                                      const std::string& origin);
// Checks that the manifest is the one of (`node_id`, `step`) and that every record is bounded
// and consistent: one file per rank, regions unique per rank, chunk counts and CRC lists that
// match their sizes, aligned offsets that lie (overflow-checked) within their file and do not
// overlap.
absl::Status CheckManifest(const v1::DurableManifest& manifest, uint32_t node_id, int64_t step);

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_MANIFEST_H_
