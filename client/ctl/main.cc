// moesnapctl: the operator's view of a node's moesnapd, over the daemon's admin socket.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/byte_size.h"
#include "client/ctl/durable_format.h"
#include "client/ctl/export.h"
#include "client/ctl/format.h"
#include "client/ctl/json.h"
#include "client/ctl/plan.h"
#include "client/ctl/progress_bar.h"
#include "common/version.h"
#include "proto/moesnap.grpc.pb.h"

namespace {

struct Session {
  std::string socket_path;
  bool json = false;
  int timeout_seconds = 30;

  // A failure as text on stderr, or under --json as a JSON error object on stdout (where a script
  // reads the result); returns `exit_code`.
  int Fail(const std::string& code, const std::string& message, int exit_code) const {
    if (json) {
      std::fputs(moesnap::ctl::JsonError(code, message, exit_code).c_str(), stdout);
    } else {
      std::fprintf(stderr, "moesnapctl: %s\n", message.c_str());
    }
    return exit_code;
  }

  // Calls `rpc` and prints the response with `format` (or as JSON); returns the exit code.
  template <typename Response, typename Rpc, typename Format>
  int Run(Rpc rpc, Format format) {
    auto stub = moesnap::v1::Admin::NewStub(
        grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(timeout_seconds));
    Response response;
    const grpc::Status status = rpc(*stub, context, response);
    if (!status.ok()) {
      return Fail(moesnap::ctl::ErrorCodeWord(status),
                  json ? moesnap::ctl::DescribeError(status, socket_path)
                       : moesnap::ctl::DescribeErrorWithCode(status, socket_path),
                  moesnap::ctl::ExitCodeFor(status));
    }
    const std::string text = json ? moesnap::ctl::Json(response) : format(response);
    std::fputs(text.c_str(), stdout);
    return moesnap::ctl::kSuccess;
  }
};

// moesnapctl export: streams the step from the daemon into safetensors files.
int RunExport(Session& session, const moesnap::v1::ExportRequest& request, const std::string& out) {
  using namespace moesnap;
  auto stub = v1::Admin::NewStub(
      grpc::CreateChannel("unix:" + session.socket_path, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::ExportChunk>> reader = stub->Export(&context, request);
  v1::ExportChunk chunk;
  std::unique_ptr<ctl::SafetensorsExport> files;
  // The bar counts the bytes received here; the daemon only streams them.
  std::atomic<uint64_t> received{0};
  std::atomic<uint64_t> expected{0};
  const auto started = std::chrono::steady_clock::now();
  ctl::ProgressWatcher progress(
      [&]() -> std::optional<v1::OperationProgress> {
        if (expected.load() == 0) return std::nullopt;
        v1::OperationProgress now;
        now.set_kind("export");
        now.set_unit("bytes");
        now.set_done(received.load());
        now.set_total(expected.load());
        now.set_seconds(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
        return now;
      },
      ctl::ProgressWatcher::Wanted(session.json));
  absl::Status written;
  while (written.ok() && reader->Read(&chunk)) {
    if (chunk.has_header() && files == nullptr) {
      absl::StatusOr<std::unique_ptr<ctl::SafetensorsExport>> begun =
          ctl::SafetensorsExport::Begin(out, chunk.header());
      written = begun.status();
      if (begun.ok()) files = *std::move(begun);
      if (begun.ok()) expected = files->bytes_expected();
    } else if (chunk.has_data() && files != nullptr) {
      written = files->Add(chunk.data());
      received = files->bytes_received();
    } else {
      written = absl::DataLossError("the daemon's export stream is out of order");
    }
  }
  if (!written.ok()) context.TryCancel();
  const grpc::Status status = reader->Finish();
  if (written.ok() && !status.ok()) {
    return session.Fail(ctl::ErrorCodeWord(status),
                        session.json ? ctl::DescribeError(status, session.socket_path)
                                     : ctl::DescribeErrorWithCode(status, session.socket_path),
                        ctl::ExitCodeFor(status));
  }
  if (written.ok() && files == nullptr) written = absl::DataLossError("the daemon sent no header");
  if (written.ok()) written = files->Finish();
  if (!written.ok()) {
    return session.Fail("export_failed", absl::StrCat("export: ", written.message()),
                        ctl::kDaemonRefused);
  }
  std::vector<std::string> names = files->files();
  if (session.json) {
    std::vector<std::string> quoted;
    for (const std::string& name : names) quoted.push_back(JsonString(name));
    std::printf("{\"directory\":%s,\"bytes\":%llu,\"files\":[%s]}\n", JsonString(out).c_str(),
                static_cast<unsigned long long>(files->bytes_received()),
                absl::StrJoin(quoted, ",").c_str());
  } else {
    std::printf("exported %s into %s: %s\n", FormatByteSize(files->bytes_received()).c_str(),
                out.c_str(), absl::StrJoin(names, ", ").c_str());
  }
  return ctl::kSuccess;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moesnap;
  Session session;
  const char* socket_from_environment = std::getenv("MOESNAP_ADMIN_SOCKET");
  session.socket_path = socket_from_environment ? socket_from_environment : "/run/moesnap/admin.sock";

  CLI::App app{"moesnapctl: inspect and manage the snapshots a node's moesnapd holds"};
  app.footer(
      "Exit codes: 0 success; 1 the command ran and found a problem (verify: corrupt chunks); "
      "2 usage error; 3 the daemon is unreachable or did not answer in time; 4 the daemon refused "
      "or failed the request (its message is printed).");
  app.require_subcommand(1);
  // Global flags may stand anywhere on the line ("moesnapctl status --json"): subcommands created
  // after this pass the options they do not know up to the app.
  app.fallthrough();
  app.set_version_flag("--version", VersionLine("moesnapctl"));
  app.add_option("--socket", session.socket_path,
                 "Admin socket of the daemon (default: $MOESNAP_ADMIN_SOCKET, else "
                 "/run/moesnap/admin.sock)");
  app.add_flag("--json", session.json, "Print one JSON object instead of tables");
  app.add_option("--timeout", session.timeout_seconds, "Seconds to wait for the daemon")
      ->check(CLI::PositiveNumber);

  auto* status = app.add_subcommand("status", "Pool capacity and use, ranks, journal, uptime");
  auto* ls = app.add_subcommand("ls", "Every stored step of every rank, with its state and size");
  int64_t step = 0;
  uint32_t rank = 0;
  auto* inspect = app.add_subcommand(
      "inspect", "The regions one step holds: dtype, shape, bytes, chunks. Without STEP: the sparse "
                 "windows of every rank (the last committed one and the open one, their slots and "
                 "the operators each slot captured whole) and the upstream log's memory");
  auto* inspect_step = inspect->add_option("STEP", step, "Step to inspect");
  auto* inspect_rank = inspect->add_option("--rank", rank, "Only this rank");
  auto* verify = app.add_subcommand(
      "verify", "Recompute the CRC-32C of every stored chunk (of STEP, or of everything)");
  auto* verify_step = verify->add_option("STEP", step, "Only this step");
  bool repair = false;
  verify->add_flag("--repair", repair,
                   "In a cluster: rebuild every corrupt chunk and parity unit from the group's "
                   "other nodes, rewrite it and check it again");
  auto* drop = app.add_subcommand("drop", "Delete a step's stored versions and free their memory");
  drop->add_option("STEP", step, "Step to drop")->required();
  auto* drop_rank = drop->add_option("--rank", rank, "Only this rank");
  auto* drop_rank_command = app.add_subcommand(
      "drop-rank", "Leave rank RANK out of this node's steps until it snapshots again (a trainer "
                   "that registered and stopped snapshotting holds every step of the node)");
  drop_rank_command->add_option("RANK", rank, "Rank to leave out")->required();
  auto* cluster = app.add_subcommand("cluster", "The cluster as this node sees it");
  cluster->require_subcommand(1);
  auto* cluster_status = cluster->add_subcommand(
      "status", "Nodes, groups, liveness, latest committed step, memory per node (data, parity, "
                "in flight)");
  uint32_t node = 0;
  auto* rebuild = app.add_subcommand(
      "rebuild", "Make node NODE rebuild its data and parity of the latest committed step from its "
                 "group (a replacement daemon does this by itself when it starts)");
  rebuild->add_option("NODE", node, "Node id")->required();
  auto* plan = app.add_subcommand(
      "plan", "Place expert replicas to survive node failures (Lazarus): allocation, placement, "
              "recovery probability per number of failed nodes against a spread placement, and with "
              "--failed the transfers that rebuild the placement on the survivors. Needs no daemon");
  auto* durable = app.add_subcommand("durable", "The durable tier: committed steps drained to disk");
  durable->require_subcommand(1);
  auto* durable_ls = durable->add_subcommand(
      "ls", "Steps on this node's disk (size, age, ranks), the drain's state and why it fails, and "
            "the newest step durable on every node of the job");
  auto* restore_tier = app.add_subcommand(
      "restore-tier", "Which tier the next restore of a rank would be served from (memory, or the "
                      "newest step durable on every node), and why");
  restore_tier->add_option("--rank", rank, "The rank (default 0)");
  auto* export_step = app.add_subcommand(
      "export", "Write a committed step as safetensors files (one per rank, non-tensor regions in "
                "a side file, index.json), from memory or from the durable tier; moesnap.load(DIR) "
                "reads them without a daemon");
  auto* export_at = export_step->add_option(
      "--step", step, "The step (default: the latest committed in memory, else the newest on disk)");
  auto* export_rank = export_step->add_option("--rank", rank, "Only this rank");
  std::string export_format = "safetensors";
  export_step->add_option("--format", export_format, "File format")
      ->check(CLI::IsMember({"safetensors"}));
  std::string export_tier = "auto";
  export_step->add_option("--tier", export_tier,
                          "Where from: memory, durable, or auto (memory when it holds the step)")
      ->check(CLI::IsMember({"auto", "memory", "durable"}));
  std::string export_out;
  export_step->add_option("--out", export_out, "Folder to write (created if missing)")->required();
  std::string loads_path;
  ctl::PlanRequest plan_request;
  plan->add_option("--loads", loads_path,
                   "File of expert token loads: one number per expert, white-space separated")
      ->required()
      ->check(CLI::ExistingFile);
  plan->add_option("--nodes", plan_request.options.nodes, "Nodes N")->required()->check(CLI::PositiveNumber);
  plan->add_option("--slots", plan_request.options.slots, "Expert slots per node c")
      ->required()
      ->check(CLI::PositiveNumber);
  plan->add_option("--min-replicas", plan_request.options.min_replicas,
                   "Replicas every expert gets at least (f; default 1)")
      ->check(CLI::PositiveNumber);
  plan->add_option("--failed", plan_request.failed, "Failed node ids, comma-separated")->delimiter(',');
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    // --help and --version are "errors" with exit code 0; every real one becomes the usage code.
    if (error.get_exit_code() == 0) return app.exit(error);
    // Parsing stopped at the error, so --json may not have been read yet: look for it on the line.
    session.json = std::find(argv + 1, argv + argc, std::string("--json")) != argv + argc;
    if (!session.json) {
      app.exit(error);
      return ctl::kUsage;
    }
    return session.Fail("usage", error.what(), ctl::kUsage);
  }

  if (*plan) {
    std::stringstream text;
    text << std::ifstream(loads_path).rdbuf();
    absl::StatusOr<std::vector<double>> loads = ctl::ParseLoads(text.str());
    absl::StatusOr<std::string> out = absl::InvalidArgumentError("");
    if (loads.ok()) {
      plan_request.loads = *std::move(loads);
      out = ctl::RunPlan(plan_request, session.json);
    } else {
      out = loads.status();
    }
    if (!out.ok()) {
      return session.Fail("usage", "plan: " + std::string(out.status().message()), ctl::kUsage);
    }
    std::fputs(out->c_str(), stdout);
    return ctl::kSuccess;
  }
  using Stub = v1::Admin::Stub;
  if (*durable_ls) {
    return session.Run<v1::ListDurableResponse>(
        [](Stub& stub, grpc::ClientContext& context, v1::ListDurableResponse& response) {
          return stub.ListDurable(&context, v1::ListDurableRequest(), &response);
        },
        [](const v1::ListDurableResponse& response) {
          return ctl::FormatDurableList(response, absl::ToUnixMillis(absl::Now()));
        });
  }
  if (*restore_tier) {
    v1::RestoreTierRequest request;
    request.set_rank(rank);
    return session.Run<v1::RestoreTierResponse>(
        [&](Stub& stub, grpc::ClientContext& context, v1::RestoreTierResponse& response) {
          return stub.RestoreTier(&context, request, &response);
        },
        [&](const v1::RestoreTierResponse& response) {
          return ctl::FormatRestoreTier(rank, response);
        });
  }
  if (*export_step) {
    v1::ExportRequest request;
    if (*export_at) request.set_step(step);
    if (*export_rank) request.set_rank(rank);
    request.set_tier(export_tier == "memory"    ? v1::TIER_MEMORY
                     : export_tier == "durable" ? v1::TIER_DURABLE
                                                : v1::TIER_UNSPECIFIED);
    return RunExport(session, request, export_out);
  }
  if (*status) {
    return session.Run<v1::StatusResponse>(
        [](Stub& stub, grpc::ClientContext& context, v1::StatusResponse& response) {
          return stub.Status(&context, v1::StatusRequest(), &response);
        },
        ctl::FormatStatus);
  }
  if (*ls) {
    return session.Run<v1::ListStepsResponse>(
        [](Stub& stub, grpc::ClientContext& context, v1::ListStepsResponse& response) {
          return stub.ListSteps(&context, v1::ListStepsRequest(), &response);
        },
        ctl::FormatSteps);
  }
  if (*inspect && !*inspect_step) {
    v1::ListWindowsRequest request;
    if (*inspect_rank) request.set_rank(rank);
    return session.Run<v1::ListWindowsResponse>(
        [&](Stub& stub, grpc::ClientContext& context, v1::ListWindowsResponse& response) {
          return stub.ListWindows(&context, request, &response);
        },
        ctl::FormatWindows);
  }
  if (*inspect) {
    v1::InspectStepRequest request;
    request.set_step(step);
    if (*inspect_rank) request.set_rank(rank);
    return session.Run<v1::InspectStepResponse>(
        [&](Stub& stub, grpc::ClientContext& context, v1::InspectStepResponse& response) {
          return stub.InspectStep(&context, request, &response);
        },
        ctl::FormatInspect);
  }
  if (*cluster_status) {
    return session.Run<v1::ClusterStatusResponse>(
        [](Stub& stub, grpc::ClientContext& context, v1::ClusterStatusResponse& response) {
          return stub.ClusterStatus(&context, v1::ClusterStatusRequest(), &response);
        },
        ctl::FormatClusterStatus);
  }
  if (*rebuild) {
    // The bar follows a rebuild this daemon runs itself (NODE is this node).
    ctl::ProgressWatcher progress(ctl::ProgressWatcher::FromDaemon(session.socket_path, "rebuild"),
                                  ctl::ProgressWatcher::Wanted(session.json));
    v1::RebuildRequest request;
    request.set_node_id(node);
    return session.Run<v1::RebuildResponse>(
        [&](Stub& stub, grpc::ClientContext& context, v1::RebuildResponse& response) {
          return stub.Rebuild(&context, request, &response);
        },
        [&](const v1::RebuildResponse& response) { return ctl::FormatRebuild(node, response); });
  }
  if (*verify) {
    ctl::ProgressWatcher progress(ctl::ProgressWatcher::FromDaemon(session.socket_path, "verify"),
                                  ctl::ProgressWatcher::Wanted(session.json));
    v1::VerifyRequest request;
    if (*verify_step) request.set_step(step);
    request.set_repair(repair);
    bool corrupt = false;
    const int code = session.Run<v1::VerifyResponse>(
        [&](Stub& stub, grpc::ClientContext& context, v1::VerifyResponse& response) {
          grpc::Status result = stub.Verify(&context, request, &response);
          corrupt = response.corruptions_size() > 0 || response.parity_units_corrupt() > 0;
          return result;
        },
        ctl::FormatVerify);
    return code == ctl::kSuccess && corrupt ? ctl::kProblemFound : code;
  }
  if (*drop_rank_command) {
    v1::DropRankRequest request;
    request.set_rank(rank);
    return session.Run<v1::DropRankResponse>(
        [&](Stub& stub, grpc::ClientContext& context, v1::DropRankResponse& response) {
          return stub.DropRank(&context, request, &response);
        },
        [&](const v1::DropRankResponse&) {
          return absl::StrCat("rank ", rank, " is left out of this node's steps until its next "
                              "snapshot\n");
        });
  }
  v1::DropStepRequest request;
  request.set_step(step);
  if (*drop_rank) request.set_rank(rank);
  return session.Run<v1::DropStepResponse>(
      [&](Stub& stub, grpc::ClientContext& context, v1::DropStepResponse& response) {
        return stub.DropStep(&context, request, &response);
      },
      [&](const v1::DropStepResponse& response) { return ctl::FormatDrop(step, response); });
}
