// The memory handoff: how a trainer gives moesnapd its host memory. Over a Unix SOCK_SEQPACKET
// socket (the agent socket's path + ".memory"), each request carries up to kMaxFilesPerRequest file
// descriptors (SCM_RIGHTS) of shared-memory files the trainer maps (memfd, or /dev/shm files such
// as PyTorch's shared storages), and the session token Hello returned. The daemon maps each file
// once and answers with the ids regions refer to (RegionHandle.memory). No file is ever opened by
// name, so the daemon reads and writes only memory a trainer handed it. When a trainer's connection
// closes its session ends; the daemon may keep its larger files for a while for the rank's next
// process, which asks for one by size (AdoptRequest) instead of allocating. Little-endian, fixed
// layout, both sides C++.
#ifndef MOESNAP_COMMON_MEMORY_HANDOFF_WIRE_H_
#define MOESNAP_COMMON_MEMORY_HANDOFF_WIRE_H_

#include <cstdint>

namespace moesnap::memory_handoff {

inline constexpr char kSocketSuffix[] = ".memory";
inline constexpr uint32_t kRequestMagic = 0x484d534d;   // "MSMH"
inline constexpr uint32_t kResponseMagic = 0x524d534d;  // "MSMR"
inline constexpr uint32_t kAdoptMagic = 0x414d534d;     // "MSMA"
inline constexpr uint32_t kMaxFilesPerRequest = 64;
inline constexpr uint32_t kSessionBytes = 16;
inline constexpr uint32_t kMaxMessageBytes = 512;
// The gRPC metadata key under which a trainer presents its session on every Agent call after Hello:
// the daemon acts only for the rank that session was bound to.
inline constexpr char kSessionMetadataKey[] = "moesnap-session-bin";

struct Request {
  uint32_t magic = kRequestMagic;
  // The number of descriptors attached. A connection's first request (0 files: the client's)
  // binds it to the session, so the session, and the rank it holds, live exactly as long as the
  // connection; a session has one: a second connection presenting it is refused.
  uint32_t files = 0;
  uint8_t session[kSessionBytes] = {};
};

struct Response {
  uint32_t magic = kResponseMagic;
  uint32_t code = 0;            // absl::StatusCode; 0: the files are mapped
  uint64_t first_id = 0;        // ids first_id .. first_id + files - 1, in the request's order
  uint32_t message_bytes = 0;   // followed by the error message, at most kMaxMessageBytes
  uint32_t reserved = 0;
};

// The size of the file that holds `bytes` in huge pages of `huge_page_bytes` (hugetlbfs sizes files
// in whole pages), or in ordinary shared memory (`huge_page_bytes` 0: to the byte); 0 when that
// does not fit in 64 bits.
inline constexpr uint64_t FileBytesFor(uint64_t bytes, uint64_t huge_page_bytes) {
  if (huge_page_bytes == 0 || bytes % huge_page_bytes == 0) return bytes;
  const uint64_t padding = huge_page_bytes - bytes % huge_page_bytes;
  return bytes > UINT64_MAX - padding ? 0 : bytes + padding;
}

// Asks for a file that holds `bytes` bytes (FileBytesFor: of exactly `bytes`, or in huge pages
// rounded up to whole ones) that an exited process of the session's rank handed over, on a
// connection already bound to the session. Answered by a Response: code 0 with the file's
// descriptor attached (SCM_RIGHTS) and its id in first_id, or NOT_FOUND saying why none is to be
// had (then the trainer allocates). The file holds the earlier process's bytes, not zeros.
struct AdoptRequest {
  uint32_t magic = kAdoptMagic;
  uint32_t reserved = 0;
  uint8_t session[kSessionBytes] = {};
  uint64_t bytes = 0;
};

static_assert(sizeof(Request) == 24 && sizeof(Response) == 24 && sizeof(AdoptRequest) == 32,
              "fixed wire layout");

}  // namespace moesnap::memory_handoff

#endif  // MOESNAP_COMMON_MEMORY_HANDOFF_WIRE_H_
