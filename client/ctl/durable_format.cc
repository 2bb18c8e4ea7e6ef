// Durable-tier tables and lines.
#include "client/ctl/durable_format.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/ctl/format.h"
#include "common/byte_size.h"

namespace moesnap::ctl {
namespace {

std::string Age(int64_t milliseconds) {
  const int64_t seconds = milliseconds / 1000;
  if (seconds < 120) return absl::StrCat(seconds, " s");
  if (seconds < 7200) return absl::StrCat(seconds / 60, " min");
  if (seconds < 172800) return absl::StrCat(seconds / 3600, " h");
  return absl::StrCat(seconds / 86400, " d");
}

}  // namespace

std::string TierWord(v1::Tier tier) {
  switch (tier) {
    case v1::TIER_MEMORY:
      return "memory";
    case v1::TIER_DURABLE:
      return "durable";
    default:
      return "none";
  }
}

std::string DescribeDurable(const v1::DurableStatus& durable) {
  if (!durable.enabled()) return "off";
  std::vector<std::string> parts;
  parts.push_back(durable.has_latest_step() ? absl::StrCat("step ", durable.latest_step(), " durable")
                                            : "no step durable yet");
  if (durable.has_draining_step()) {
    parts.push_back(absl::StrCat("draining step ", durable.draining_step(), " (",
                                 FormatByteSize(durable.draining_bytes_written()), " of ",
                                 FormatByteSize(durable.draining_bytes()), ")"));
  }
  if (durable.drains_skipped() > 0) {
    parts.push_back(absl::StrCat(durable.drains_skipped(), " due steps skipped while draining"));
  }
  if (!durable.last_error().empty()) parts.push_back(absl::StrCat("FAILING: ", durable.last_error()));
  return absl::StrJoin(parts, "; ");
}

std::string FormatDurableList(const v1::ListDurableResponse& list, int64_t now_unix_ms) {
  const v1::DurableStatus& status = list.status();
  if (!status.enabled()) return "the durable tier is off ([durable] directory is not set)\n";
  std::string out = absl::StrCat("directory: ", status.directory(), "\n");
  absl::StrAppend(&out, "drain: ", DescribeDurable(status), "\n");
  absl::StrAppend(&out, "newest step durable on every node: ",
                  list.has_newest_everywhere() ? absl::StrCat(list.newest_everywhere())
                  : list.everywhere_unknown().empty() ? "none"
                                                      : absl::StrCat("unknown: ", list.everywhere_unknown()),
                  "\n");
  if (list.steps_size() == 0) return out + "no step on disk\n";
  std::vector<std::vector<std::string>> rows = {{"STEP", "BYTES", "AGE", "RANKS", "REGIONS", "NOTE"}};
  for (const v1::DurableStepInfo& step : list.steps()) {
    rows.push_back({absl::StrCat(step.step()), FormatByteSize(step.bytes()),
                    step.created_unix_ms() > 0 ? Age(now_unix_ms - step.created_unix_ms()) : "-",
                    absl::StrJoin(step.ranks(), ","), absl::StrCat(step.regions()),
                    !step.problem().empty()       ? absl::StrCat("unreadable: ", step.problem())
                    : step.durable_everywhere() ? "newest on every node"
                                                : ""});
  }
  return out + Table(rows);
}

std::string FormatRestoreTier(uint32_t rank, const v1::RestoreTierResponse& tier) {
  if (tier.tier() == v1::TIER_UNSPECIFIED) {
    return absl::StrCat("rank ", rank, ": nothing to restore (", tier.reason(), ")\n");
  }
  return absl::StrCat("rank ", rank, ": ", TierWord(tier.tier()),
                      tier.has_step() ? absl::StrCat(", step ", tier.step()) : "", " (",
                      tier.reason(), ")\n");
}

}  // namespace moesnap::ctl
