// moesnapctl export: a step streamed by the daemon (ExportChunk: a header, then every region's
// bytes) written as files that load anywhere: per rank, rank-<R>.safetensors with every tensor
// region (name, dtype and shape from the region's metadata) and rank-<R>.other.safetensors with
// the other regions (pickled state, free-form bytes) as U8 tensors, plus index.json describing
// every region. Each chunk's CRC-32C is checked as its bytes land; files are written under
// temporary names and renamed only once every byte has arrived and been checked.
#ifndef MOESNAP_CLIENT_CTL_EXPORT_H_
#define MOESNAP_CLIENT_CTL_EXPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/moesnap.pb.h"

namespace moesnap::ctl {

inline constexpr char kExportIndexName[] = "index.json";

// Not thread-safe: one stream feeds it.
class SafetensorsExport {
 public:
  // Creates `directory` if needed and the files the header calls for.
  static absl::StatusOr<std::unique_ptr<SafetensorsExport>> Begin(const std::string& directory,
                                                                  const v1::ExportHeader& header);
  ~SafetensorsExport();  // removes the temporary files of an export that did not finish

  // A piece of a region's bytes; pieces of a region come in order.
  absl::Status Add(const v1::ExportData& data);
  // Checks that every byte arrived, syncs and renames the files, writes index.json.
  absl::Status Finish();

  uint64_t bytes_received() const { return received_; }
  uint64_t bytes_expected() const { return header_.bytes(); }
  // The files written, index.json last.
  std::vector<std::string> files() const;

 private:
  struct Destination;
  struct OutputFile;
  SafetensorsExport(std::string directory, v1::ExportHeader header);
  absl::Status Plan();

  const std::string directory_;
  const v1::ExportHeader header_;
  std::vector<Destination> destinations_;  // by region index
  std::vector<OutputFile> files_;
  uint64_t received_ = 0;
  bool finished_ = false;
};

}  // namespace moesnap::ctl

#endif  // MOESNAP_CLIENT_CTL_EXPORT_H_
