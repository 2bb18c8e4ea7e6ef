// A complete step read back from disk, as untrusted input: its manifest is parsed and checked
// (bounds, overflow, consistency) and every data file's size must be what the manifest says before
// any byte is used; every chunk read is checked against its CRC-32C.
#ifndef MOESNAP_DAEMON_DURABLE_STEP_READER_H_
#define MOESNAP_DAEMON_DURABLE_STEP_READER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/durable/durable_directory.h"
#include "proto/moesnap.pb.h"

namespace moesnap::daemon::durable {

// Thread-safe for reads. The data files stay open, so a step deleted while it is read (retention)
// is still read whole.
class StepReader {
 public:
  static absl::StatusOr<std::unique_ptr<StepReader>> Open(const DurableDirectory& directory,
                                                          int64_t step);
  ~StepReader();
  StepReader(const StepReader&) = delete;
  StepReader& operator=(const StepReader&) = delete;

  const v1::DurableManifest& manifest() const { return manifest_; }
  // Index of region `name` of `rank` in the manifest, or NOT_FOUND.
  absl::StatusOr<int> Find(uint32_t rank, const std::string& name) const;
  // Reads chunk `chunk` of region `region` (its whole length) into `out` and checks its CRC-32C.
  absl::Status ReadChunk(int region, uint32_t chunk, uint8_t* out) const;

 private:
  StepReader(std::string path, v1::DurableManifest manifest)
      : path_(std::move(path)), manifest_(std::move(manifest)) {}

  const std::string path_;
  const v1::DurableManifest manifest_;
  std::map<uint32_t, int> files_;  // rank -> open data file
};

}  // namespace moesnap::daemon::durable

#endif  // MOESNAP_DAEMON_DURABLE_STEP_READER_H_
