#include "client/ctl/format.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/ctl/progress_bar.h"
#include "client/ctl/durable_format.h"
#include "common/byte_size.h"
#include "proto/step_state_name.h"

namespace moesnap::ctl {

ExitCode ExitCodeFor(const grpc::Status& status) {
  if (status.ok()) return kSuccess;
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return kDaemonUnreachable;
  }
  return kDaemonRefused;
}

std::string DescribeError(const grpc::Status& status, const std::string& socket_path) {
  if (ExitCodeFor(status) == kDaemonUnreachable) {
    return absl::StrCat("cannot reach moesnapd at ", socket_path,
                        " (is the service running? try: systemctl status moesnapd): ",
                        status.error_message());
  }
  return status.error_message();
}

std::string DescribeErrorWithCode(const grpc::Status& status, const std::string& socket_path) {
  if (ExitCodeFor(status) == kDaemonUnreachable) return DescribeError(status, socket_path);
  return absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                      ": ", status.error_message());
}

std::string ErrorCodeWord(const grpc::Status& status) {
  return absl::AsciiStrToLower(
      absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())));
}

std::string Table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()), 0);
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      absl::StrAppend(&line, row[i], i + 1 < row.size() ? std::string(widths[i] - row[i].size() + 2, ' ') : "");
    }
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

std::string FormatStatus(const v1::StatusResponse& status) {
  std::vector<std::vector<std::string>> rows = {
      {"node", absl::StrCat(status.node_id(), " (moesnapd pid ", status.pid(), ")")},
      {"pool", absl::StrCat("/dev/shm/", status.pool_name(), " ", FormatByteSize(status.pool_bytes()),
                            status.pool_locked() ? ", page-locked" : ", not page-locked")},
      {"committed", FormatByteSize(status.pool_used_bytes())},
      {"in flight", FormatByteSize(status.pool_in_flight_bytes())},
      {"free", FormatByteSize(status.pool_bytes() - status.pool_used_bytes() -
                              status.pool_in_flight_bytes())},
      {"ranks", absl::StrCat(status.ranks())},
      {"superseded", absl::StrCat(status.steps_superseded(),
                                  " captured steps dropped: a newer step committed first")},
      {"skipped", status.snapshots_skipped() == 0
                      ? std::string("0 snapshots")
                      : absl::StrCat(status.snapshots_skipped(), " snapshots, the last: ",
                                     status.last_skip())},
      {"journal", absl::StrCat("sequence ", status.journal_sequence())},
      {"uptime", absl::StrCat(status.uptime_seconds(), " s")},
      {"durable", DescribeDurable(status.durable())},
  };
  for (const v1::DroppedRank& dropped : status.dropped_ranks()) {
    rows.push_back({"left out", absl::StrCat("rank ", dropped.rank(), ": ", dropped.reason())});
  }
  for (const v1::OperationProgress& operation : status.operations()) {
    rows.push_back({"running", RenderProgress(operation, 20)});
  }
  for (const v1::RankCapture& capture : status.rank_captures()) {
    rows.push_back({"captured", absl::StrCat("rank ", capture.rank(), " step ", capture.step(), ": ",
                                             FormatByteSize(capture.bytes()), " of ",
                                             FormatByteSize(capture.state_bytes()), " registered")});
  }
  return Table(rows);
}

std::string FormatSteps(const v1::ListStepsResponse& steps) {
  if (steps.steps_size() == 0) return "no steps stored\n";
  std::vector<std::vector<std::string>> rows = {{"RANK", "STEP", "STATE", "REGIONS", "BYTES"}};
  for (const v1::StepInfo& step : steps.steps()) {
    rows.push_back({absl::StrCat(step.rank()), absl::StrCat(step.step()), StepStateName(step.state()),
                    absl::StrCat(step.regions()), FormatByteSize(step.bytes())});
  }
  return Table(rows);
}

std::string FormatInspect(const v1::InspectStepResponse& inspect) {
  v1::ListStepsResponse steps;
  *steps.mutable_steps() = inspect.steps();
  const std::string out = FormatSteps(steps);
  std::vector<std::vector<std::string>> rows = {
      {"RANK", "REGION", "DTYPE", "SHAPE", "BYTES", "CHUNKS", "PIECE"}};
  for (const v1::VersionInfo& version : inspect.versions()) {
    const std::string piece =
        version.has_piece()
            ? absl::StrCat(version.piece().replica_group(), " [", version.piece().offset(), ", ",
                           version.piece().offset() + version.bytes(), ") of ",
                           version.piece().region_bytes())
            : std::string("whole");
    rows.push_back({absl::StrCat(version.rank()), version.region(), version.dtype(),
                    absl::StrCat("[", absl::StrJoin(version.shape(), ","), "]"),
                    FormatByteSize(version.bytes()), absl::StrCat(version.chunks()), piece});
  }
  std::string groups;
  if (inspect.replica_groups_size() > 0) {
    std::vector<std::vector<std::string>> group_rows = {
        {"RANK", "REPLICA GROUP", "SHARD", "MEMBERS", "SHARDS HELD ON"}};
    for (const v1::RankReplicaGroup& group : inspect.replica_groups()) {
      const auto& members = group.layout().group().ranks();
      const auto index = std::find(members.begin(), members.end(), group.rank()) - members.begin();
      // In a cluster, the node holding each member's shard ("?": a node of another group).
      std::vector<std::string> held;
      for (uint32_t member : members) {
        auto node = group.member_nodes().find(member);
        held.push_back(absl::StrCat(member, ": ",
                                    node == group.member_nodes().end()
                                        ? std::string("?")
                                        : absl::StrCat("node ", node->second)));
      }
      group_rows.push_back({absl::StrCat(group.rank()), group.layout().group().name(),
                            absl::StrCat(index, " of ", members.size()),
                            absl::StrCat("ranks [", absl::StrJoin(members, ", "), "]"),
                            group.member_nodes().empty() ? std::string("this node")
                                                         : absl::StrJoin(held, ", ")});
    }
    groups = absl::StrCat("\n", Table(group_rows));
  }
  return absl::StrCat(out, "\n", Table(rows), groups);
}

std::string FormatWindows(const v1::ListWindowsResponse& windows) {
  std::string out;
  if (windows.ranks_size() == 0) {
    out = "no sparse windows stored\n";
  } else {
    std::vector<std::vector<std::string>> rows = {
        {"RANK", "WINDOW", "STEPS", "BUFFER", "SLOT", "STEP", "STATE", "OPERATORS CAPTURED WHOLE"}};
    auto add = [&rows](uint32_t rank, const char* which, const v1::SparseWindow& window) {
      const std::string steps = absl::StrCat(window.first_step(), "-",
                                             window.first_step() + window.size() - 1);
      if (window.slots_size() == 0) {
        rows.push_back({absl::StrCat(rank), which, steps, absl::StrCat(window.buffer()), "-", "-",
                        "-", ""});
      }
      for (const v1::WindowSlot& slot : window.slots()) {
        rows.push_back({absl::StrCat(rank), which, steps, absl::StrCat(window.buffer()),
                        absl::StrCat(slot.slot()), absl::StrCat(slot.step()),
                        StepStateName(slot.state()), absl::StrJoin(slot.operators(), " ")});
      }
    };
    for (const v1::RankWindows& rank : windows.ranks()) {
      if (rank.has_committed_window()) add(rank.rank(), "committed", rank.committed_window());
      if (rank.has_open_window()) add(rank.rank(), "open", rank.open_window());
    }
    out = Table(rows);
    for (const v1::RankWindows& rank : windows.ranks()) {
      if (rank.has_open_window() && !rank.open_window().failure().empty()) {
        absl::StrAppend(&out, "rank ", rank.rank(), ": the open window cannot commit: ",
                        rank.open_window().failure(), "\n");
      }
    }
  }
  absl::StrAppend(&out, "upstream log: ", windows.log_records(), " records, ",
                  FormatByteSize(windows.log_bytes()), " of ",
                  FormatByteSize(windows.log_budget_bytes()),
                  windows.has_log_kept_from_step()
                      ? absl::StrCat(", steps from ", windows.log_kept_from_step(), " kept")
                      : std::string(),
                  "\n");
  return out;
}

std::string FormatVerify(const v1::VerifyResponse& verify) {
  std::string out = absl::StrCat("checked ", verify.versions_checked(), " versions, ",
                                 verify.chunks_checked(), " chunks, ",
                                 FormatByteSize(verify.bytes_checked()), ": ",
                                 verify.corruptions_size() == 0
                                     ? "every CRC-32C matches\n"
                                     : absl::StrCat(verify.corruptions_size(), " corrupt chunks\n"));
  if (verify.parity_units_checked() > 0) {
    absl::StrAppend(&out, "checked ", verify.parity_units_checked(), " parity units held for the group: ",
                    verify.parity_units_corrupt() == 0
                        ? "every CRC-32C matches\n"
                        : absl::StrCat(verify.parity_units_corrupt(), " corrupt\n"));
  }
  if (verify.chunks_repaired() > 0 || verify.parity_units_repaired() > 0) {
    absl::StrAppend(&out, "repaired ", verify.chunks_repaired(), " chunks and ",
                    verify.parity_units_repaired(), " parity units from the group\n");
  }
  if (verify.corruptions_size() == 0) return out;
  std::vector<std::vector<std::string>> rows = {{"RANK", "REGION", "STEP", "CHUNK", "STORED", "ACTUAL"}};
  for (const auto& corruption : verify.corruptions()) {
    rows.push_back({absl::StrCat(corruption.rank()), corruption.region(),
                    absl::StrCat(corruption.step()), absl::StrCat(corruption.chunk()),
                    absl::StrFormat("%08x", corruption.expected_crc()),
                    absl::StrFormat("%08x", corruption.actual_crc())});
  }
  return absl::StrCat(out, Table(rows));
}

std::string FormatDrop(int64_t step, const v1::DropStepResponse& drop) {
  return absl::StrCat("dropped ", drop.versions_dropped(), " versions of step ", step, ", freed ",
                      FormatByteSize(drop.bytes_freed()), "\n");
}

std::string FormatClusterStatus(const v1::ClusterStatusResponse& cluster) {
  std::string out = absl::StrCat(
      "node ", cluster.node_id(), " of job '", cluster.job(), "', k=", cluster.shape().data_units(),
      " m=", cluster.shape().parity_units(), ", stripe unit ",
      FormatByteSize(cluster.shape().stripe_unit_bytes()), ", latest committed step ",
      cluster.has_latest_committed_step() ? absl::StrCat(cluster.latest_committed_step()) : "none",
      "\n");
  absl::StrAppend(&out, "etcd ", absl::StrJoin(cluster.etcd_endpoints(), ","), ": ");
  if (cluster.has_etcd_unreachable_since_unix_ms()) {
    const absl::Time since = absl::FromUnixMillis(cluster.etcd_unreachable_since_unix_ms());
    absl::StrAppend(&out, "unreachable since ",
                    absl::FormatTime("%Y-%m-%d %H:%M:%S %Z", since, absl::LocalTimeZone()), " (",
                    absl::ToInt64Seconds(absl::Now() - since),
                    " s): commits are paused, captures go on\n");
  } else {
    absl::StrAppend(&out, "reachable\n");
  }
  absl::StrAppend(&out, "peers: ",
                  cluster.peer_tls() ? "mutual TLS" : "plaintext on loopback (tls.insecure)", ", ",
                  cluster.peer_refusals(), " refused\n");
  if (!cluster.last_peer_refusal().empty()) {
    absl::StrAppend(&out, "last peer refused: ", cluster.last_peer_refusal(), "\n");
  }
  if (cluster.data_connections_closed() > 0) {
    absl::StrAppend(&out, "data connections closed over a bad frame: ",
                    cluster.data_connections_closed(), " (last: ",
                    cluster.last_data_connection_closed(), ")\n");
  }
  if (cluster.absent_nodes_size() > 0) {
    absl::StrAppend(&out, "degraded: nodes [", absl::StrJoin(cluster.absent_nodes(), ", "),
                    "] absent from the latest committed step (their data is their last committed "
                    "image; replace them to restore full protection); ",
                    cluster.degraded_commits(), " degraded commits\n");
  }
  if (!cluster.last_abort().empty()) absl::StrAppend(&out, "last abort: ", cluster.last_abort(), "\n");
  if (!cluster.rebuild_error().empty()) {
    absl::StrAppend(&out, "last rebuild failed (tried again): ", cluster.rebuild_error(), "\n");
  }
  std::vector<std::vector<std::string>> rows = {{"NODE", "GROUP", "POS", "ADDRESS", "HOST", "STATE",
                                                 "COMMITTED", "DATA", "PARITY", "IN FLIGHT"}};
  for (const v1::ClusterNodeStatus& node : cluster.nodes()) {
    std::string state = node.live() ? "live" : "lost";
    if (node.live() && node.rebuilding()) {
      state = node.received_steps() > 0
                  ? absl::StrCat("rebuilding, receiving parity (", node.received_steps(),
                                 " committed steps to catch up)")
                  : "rebuilding";
    }
    if (node.live() && !node.answered()) state = "live, not answering";
    if (node.coordinator()) {
      absl::StrAppend(&state, ", coordinator (token ", cluster.coordinator_token(), ")");
    }
    const bool known = node.answered();
    rows.push_back({absl::StrCat(node.node_id()), absl::StrCat(node.group()),
                    absl::StrCat(node.position()),
                    node.live() ? absl::StrCat(node.host(), ":", node.control_port(), "/",
                                               node.data_port())
                                : "-",
                    node.live() ? node.hostname() : "-", state,
                    node.has_latest_committed_step() ? absl::StrCat(node.latest_committed_step()) : "-",
                    known ? FormatByteSize(node.memory().data_bytes()) : "-",
                    known ? FormatByteSize(node.memory().parity_bytes()) : "-",
                    known ? FormatByteSize(node.memory().in_flight_bytes()) : "-"});
  }
  return absl::StrCat(out, Table(rows));
}

std::string FormatRebuild(uint32_t node, const v1::RebuildResponse& rebuild) {
  return absl::StrCat("node ", node, " rebuilt step ", rebuild.step(), ": ", rebuild.stripes(),
                      " stripes, ", FormatByteSize(rebuild.data_bytes()), " of data and ",
                      FormatByteSize(rebuild.parity_bytes()), " of parity from ",
                      FormatByteSize(rebuild.fetched_bytes()), " received (its helpers fetched ",
                      FormatByteSize(rebuild.helper_fetched_bytes()), "), in ",
                      absl::StrFormat("%.2f", rebuild.seconds()), " s\n");
}

}  // namespace moesnap::ctl
