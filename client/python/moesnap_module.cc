// moesnap._moesnap: the C++ client (libmoesnap) for Python. No protocol lives here: every call goes
// through moesnap::Client. Blocking calls release the GIL; errors become moesnap.Error carrying the
// daemon's status code name and message.
#include <pybind11/eval.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "moesnap/client.h"
#include "moesnap/placement_planner.h"
#include "moesnap/sparse_schedule.h"

namespace py = pybind11;

namespace {

// moesnap.Error, created at import; module state lives as long as the interpreter.
PyObject* g_error_type = nullptr;

[[noreturn]] void Raise(const absl::Status& status) {
  py::object error = py::reinterpret_borrow<py::object>(g_error_type)(
      std::string(absl::StatusCodeToString(status.code())), std::string(status.message()));
  PyErr_SetObject(g_error_type, error.ptr());
  throw py::error_already_set();
}

void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Value(absl::StatusOr<T> result) {
  if (!result.ok()) Raise(result.status());
  return *std::move(result);
}

// Runs a blocking client call without the GIL; the result is checked (and may raise) after the GIL
// is held again.
template <typename Call>
auto WithoutGil(Call call) {
  py::gil_scoped_release release;
  return call();
}

py::dict ReconfigurationDict(const moesnap::Reconfiguration& plan) {
  py::list transfers;
  for (const moesnap::Transfer& transfer : plan.transfers) {
    py::dict row;
    row["expert"] = transfer.expert;
    row["from"] = transfer.from ? py::object(py::int_(*transfer.from)) : py::object(py::none());
    row["to"] = transfer.to;
    row["bytes"] = transfer.bytes;
    transfers.append(row);
  }
  py::dict reconfiguration;
  reconfiguration["survivors"] = plan.survivors;
  reconfiguration["replicas"] = plan.replicas;
  reconfiguration["placement"] = plan.placement;
  reconfiguration["transfers"] = transfers;
  reconfiguration["bytes_moved"] = plan.bytes_moved;
  return reconfiguration;
}

moesnap::LogDirection ParseDirection(const std::string& direction) {
  if (direction == "forward") return moesnap::LogDirection::kForward;
  if (direction == "backward") return moesnap::LogDirection::kBackward;
  Raise(absl::InvalidArgumentError("a log direction is 'forward' (activations sent downstream) or "
                                   "'backward' (gradients sent upstream), not '" + direction + "'"));
}

}  // namespace

PYBIND11_MODULE(_moesnap, module) {
  module.doc() = "Bindings of libmoesnap, the trainer-side client of moesnapd.";

  py::dict scope;
  py::exec(R"(
class Error(Exception):
    """An error from moesnapd or libmoesnap.

    ``code`` is the status code name (for example ``'NOT_FOUND'``); ``message`` says what was wrong,
    naming the region, step and sizes involved.
    """

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
)", scope);
  py::object error_type = scope["Error"];
  error_type.attr("__module__") = "moesnap";
  module.attr("Error") = error_type;
  g_error_type = error_type.release().ptr();

  py::class_<moesnap::SharedBuffer, std::shared_ptr<moesnap::SharedBuffer>>(
      module, "SharedBuffer", py::buffer_protocol(),
      "Host memory shared with moesnapd (a /dev/shm file). Exposes the buffer protocol: wrap it "
      "with torch.frombuffer or numpy.frombuffer; keep this object alive while tensors use it.")
      .def_buffer([](moesnap::SharedBuffer& buffer) {
        return py::buffer_info(buffer.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(buffer.size())}, {1});
      })
      .def_property_readonly("size", &moesnap::SharedBuffer::size)
      .def_property_readonly("fd", &moesnap::SharedBuffer::fd)
      .def_property_readonly("address",
                             [](const moesnap::SharedBuffer& buffer) {
                               return reinterpret_cast<uintptr_t>(buffer.data());
                             });

  py::class_<moesnap::Client>(module, "Client", "A connection of one trainer rank to moesnapd.")
      .def(py::init([](const std::optional<std::string>& socket_path,
                       std::optional<uint32_t> rank, double call_timeout_s,
                       double wait_timeout_s) {
             // Unset arguments come from the launcher's environment (MOESNAP_SOCKET, RANK,
             // LOCAL_RANK), then the defaults.
             moesnap::ClientOptions options = Value(moesnap::ClientOptions::FromEnvironment());
             if (socket_path) options.socket_path = *socket_path;
             if (rank) options.rank = *rank;
             options.call_timeout = std::chrono::milliseconds(static_cast<int64_t>(call_timeout_s * 1000));
             options.wait_timeout = std::chrono::milliseconds(static_cast<int64_t>(wait_timeout_s * 1000));
             return Value(WithoutGil([&] { return moesnap::Client::Connect(options); }));
           }),
           py::arg("socket_path") = std::nullopt, py::arg("rank") = std::nullopt,
           py::arg("call_timeout_s") = 30.0,
           py::arg("wait_timeout_s") = 600.0)
      .def("allocate_host",
           [](const moesnap::Client& client, size_t bytes) { return Value(client.AllocateHost(bytes)); },
           py::arg("bytes"))
      .def(
          "share_memory",
          [](moesnap::Client& client, const std::vector<int>& fds) {
            return Value(WithoutGil([&] { return client.ShareMemory(fds); }));
          },
          py::arg("fds"),
          "Hands shared-memory files (descriptors the caller keeps open) to the daemon; returns "
          "a handle per file.")
      .def(
          "register_host_regions",
          [](moesnap::Client& client, const std::vector<py::tuple>& regions) {
            std::vector<moesnap::HostRegion> converted;
            converted.reserve(regions.size());
            for (const py::tuple& region : regions) {
              converted.push_back({{region[0].cast<std::string>(), region[4].cast<std::string>(),
                                    region[5].cast<std::vector<int64_t>>()},
                                   region[1].cast<uint64_t>(), region[2].cast<uint64_t>(),
                                   region[3].cast<uint64_t>()});
            }
            Check(WithoutGil([&] { return client.RegisterHostRegions(converted); }));
          },
          py::arg("regions"),
          "Registers (name, memory handle, offset, bytes, dtype, shape) tuples in one call.")
      .def("take_skipped_steps",
           [](moesnap::Client& client) { return client.TakeSkippedSteps(); })
      .def(
          "register_host_region",
          [](moesnap::Client& client, const std::string& name,
             std::shared_ptr<moesnap::SharedBuffer> buffer, size_t offset, size_t bytes,
             const std::string& dtype, const std::vector<int64_t>& shape) {
            Check(WithoutGil([&] {
              return client.RegisterHostRegion({name, dtype, shape}, std::move(buffer), offset, bytes);
            }));
          },
          py::arg("name"), py::arg("buffer"), py::arg("offset"), py::arg("bytes"),
          py::arg("dtype") = "", py::arg("shape") = std::vector<int64_t>{})
      .def(
          "register_device_region",
          [](moesnap::Client& client, const std::string& name, int device, uintptr_t allocation_base,
             size_t offset, size_t bytes, uintptr_t stream, const std::string& dtype,
             const std::vector<int64_t>& shape) {
            Check(WithoutGil([&] {
              return client.RegisterDeviceRegion(
                  {name, dtype, shape},
                  {device, reinterpret_cast<void*>(allocation_base), offset, bytes,
                   reinterpret_cast<void*>(stream)});
            }));
          },
          py::arg("name"), py::arg("device"), py::arg("allocation_base"), py::arg("offset"),
          py::arg("bytes"), py::arg("stream") = 0, py::arg("dtype") = "",
          py::arg("shape") = std::vector<int64_t>{})
      .def(
          "snapshot",
          [](moesnap::Client& client, int64_t step, const std::vector<std::string>& regions) {
            return Value(WithoutGil([&] { return client.Snapshot(step, regions); }));
          },
          py::arg("step"), py::arg("regions") = std::vector<std::string>{})
      .def(
          "wait_captured",
          [](moesnap::Client& client, int64_t step) {
            Check(WithoutGil([&] { return client.WaitCaptured(step); }));
          },
          py::arg("step"))
      .def(
          "commit",
          [](moesnap::Client& client, int64_t step) {
            Check(WithoutGil([&] { return client.Commit(step); }));
          },
          py::arg("step"))
      .def(
          "wait_committed",
          [](moesnap::Client& client, int64_t step) {
            Check(WithoutGil([&] { return client.WaitCommitted(step); }));
          },
          py::arg("step"))
      .def(
          "restore",
          [](moesnap::Client& client, std::optional<int64_t> step,
             const std::vector<std::string>& regions) {
            const moesnap::RestoreResult result =
                Value(WithoutGil([&] { return client.Restore(step, regions); }));
            py::list restored;
            for (const moesnap::RestoredRegion& region : result.regions) {
              restored.append(py::make_tuple(region.name, region.step, region.bytes));
            }
            return py::make_tuple(result.step, restored,
                                  result.tier == moesnap::RestoreTier::kDurable ? "durable"
                                                                                : "memory");
          },
          py::arg("step") = std::nullopt, py::arg("regions") = std::vector<std::string>{})
      .def(
          "restore_from",
          [](moesnap::Client& client, uint32_t source_rank,
             const std::vector<std::string>& regions) {
            const moesnap::RestoreResult result =
                Value(WithoutGil([&] { return client.RestoreFrom(source_rank, regions); }));
            py::list restored;
            for (const moesnap::RestoredRegion& region : result.regions) {
              restored.append(py::make_tuple(region.name, region.step, region.bytes));
            }
            return py::make_tuple(result.step, restored,
                                  result.source_node ? py::object(py::int_(*result.source_node))
                                                     : py::object(py::none()),
                                  result.decoded);
          },
          py::arg("source_rank"), py::arg("regions") = std::vector<std::string>{},
          "Elastic restore: (step, [(region, step, bytes)], the node whose snapshot served it "
          "or None on a single node, whether it was decoded from parity).")
      .def("latest_committed",
           [](moesnap::Client& client) {
             return Value(WithoutGil([&] { return client.LatestCommitted(); }));
           })
      .def(
          "snapshot_sparse",
          [](moesnap::Client& client, int64_t step, const std::vector<std::string>& regions,
             int64_t window_first_step, uint32_t window_size, uint32_t slot, uint32_t buffer,
             const std::vector<std::string>& operators) {
            const moesnap::SparseSlot sparse{window_first_step, window_size, slot, buffer, operators};
            return Value(WithoutGil([&] { return client.SnapshotSparse(step, regions, sparse); }));
          },
          py::arg("step"), py::arg("regions"), py::arg("window_first_step"),
          py::arg("window_size"), py::arg("slot"), py::arg("buffer"),
          py::arg("operators") = std::vector<std::string>{})
      .def("windows",
           [](moesnap::Client& client) {
             const moesnap::SparseWindows windows =
                 Value(WithoutGil([&] { return client.Windows(); }));
             auto convert = [](const std::optional<moesnap::SparseWindow>& window) -> py::object {
               if (!window) return py::none();
               py::list slots;
               for (const moesnap::WindowSlotState& slot : window->slots) {
                 slots.append(py::make_tuple(slot.slot, slot.step, slot.committed, slot.operators));
               }
               py::dict result;
               result["first_step"] = window->first_step;
               result["size"] = window->size;
               result["buffer"] = window->buffer;
               result["slots"] = slots;
               result["failure"] = window->failure;
               return result;
             };
             py::dict result;
             result["committed"] = convert(windows.committed);
             result["open"] = convert(windows.open);
             return result;
           })
      .def(
          "append_log",
          [](moesnap::Client& client, int64_t step, uint32_t micro_batch,
             const std::string& direction, uint32_t peer_rank, py::bytes payload) {
            const moesnap::LogDirection parsed = ParseDirection(direction);
            std::string_view bytes = payload;
            Check(WithoutGil(
                [&] { return client.AppendLog(step, micro_batch, parsed, peer_rank, bytes); }));
          },
          py::arg("step"), py::arg("micro_batch"), py::arg("direction"), py::arg("peer_rank"),
          py::arg("payload"))
      .def(
          "fetch_log",
          [](moesnap::Client& client, uint32_t sender_rank, int64_t step,
             const std::string& direction, uint32_t peer_rank) {
            const moesnap::LogDirection parsed = ParseDirection(direction);
            const std::vector<moesnap::LoggedMessage> messages = Value(WithoutGil(
                [&] { return client.FetchLog(sender_rank, step, parsed, peer_rank); }));
            py::list result;
            for (const moesnap::LoggedMessage& message : messages) {
              result.append(py::make_tuple(message.micro_batch, py::bytes(message.payload)));
            }
            return result;
          },
          py::arg("sender_rank"), py::arg("step"), py::arg("direction"), py::arg("peer_rank"))
      .def("reconnect",
           [](moesnap::Client& client) {
             Check(WithoutGil([&] { return client.Reconnect(); }));
           })
      .def_property_readonly("rank", &moesnap::Client::rank)
      .def_property_readonly("node_id", &moesnap::Client::node_id);

  py::class_<moesnap::Operator>(module, "Operator",
                                "One expert of one layer, or a layer's non-expert and gate part.")
      .def(py::init([](std::string name, bool is_expert, uint64_t full_state_bytes,
                       uint64_t weight_bytes, double token_count) {
             return moesnap::Operator{std::move(name), is_expert, full_state_bytes, weight_bytes,
                                      token_count};
           }),
           py::arg("name"), py::arg("is_expert"), py::arg("full_state_bytes"),
           py::arg("weight_bytes"), py::arg("token_count") = 0.0)
      .def_readwrite("name", &moesnap::Operator::name)
      .def_readwrite("is_expert", &moesnap::Operator::is_expert)
      .def_readwrite("full_state_bytes", &moesnap::Operator::full_state_bytes)
      .def_readwrite("weight_bytes", &moesnap::Operator::weight_bytes)
      .def_readwrite("token_count", &moesnap::Operator::token_count);

  py::class_<moesnap::SparseSchedule>(
      module, "SparseSchedule",
      "The MoEtion sparse snapshot schedule: window size, operator order, what each slot captures.")
      .def_static(
          "build",
          [](const std::vector<moesnap::Operator>& operators, double iteration_seconds,
             double copy_bytes_per_second, uint64_t every_step_bytes) {
            moesnap::ScheduleOptions options;
            options.iteration_seconds = iteration_seconds;
            options.copy_bytes_per_second = copy_bytes_per_second;
            options.every_step_bytes = every_step_bytes;
            return Value(moesnap::SparseSchedule::Build(operators, options));
          },
          py::arg("operators"), py::arg("iteration_seconds"), py::arg("copy_bytes_per_second"),
          py::arg("every_step_bytes") = 0)
      .def("with_window",
           [](const moesnap::SparseSchedule& schedule, int window) {
             return Value(schedule.WithWindow(window));
           }, py::arg("window"))
      .def_static("agreed_window", &moesnap::SparseSchedule::AgreedWindow, py::arg("windows"))
      .def_property_readonly("window", &moesnap::SparseSchedule::window)
      .def_property_readonly("budget_bytes", &moesnap::SparseSchedule::budget_bytes)
      .def_property_readonly("order", &moesnap::SparseSchedule::order)
      .def("slot_of_step", &moesnap::SparseSchedule::SlotOfStep, py::arg("step"))
      .def("captured_in_slot",
           [](const moesnap::SparseSchedule& schedule, int slot) {
             return schedule.slots().at(slot).captured;
           }, py::arg("slot"))
      .def("slot_bytes",
           [](const moesnap::SparseSchedule& schedule, int slot) {
             return schedule.slots().at(slot).bytes;
           }, py::arg("slot"))
      .def("captured_by", &moesnap::SparseSchedule::CapturedBy, py::arg("operator_index"),
           py::arg("slot"))
      .def("needs_reorder", &moesnap::SparseSchedule::NeedsReorder, py::arg("token_counts"))
      .def("needs_regeneration", &moesnap::SparseSchedule::NeedsRegeneration,
           py::arg("iteration_seconds"));

  module.def(
      "plan",
      [](const std::vector<double>& loads, int nodes, int slots, int min_replicas,
         const std::vector<int>& failed) {
        const moesnap::PlanOptions options{nodes, slots, min_replicas};
        const std::vector<int> replicas = Value(moesnap::AllocateReplicas(loads, options));
        const moesnap::Placement overlap = Value(moesnap::PlaceMaximumOverlap(replicas, options));
        const moesnap::Placement spread = Value(moesnap::PlaceSpread(replicas, options));
        const int experts = static_cast<int>(loads.size());
        const auto with_overlap = moesnap::RecoveryProbabilities(overlap, experts);
        const auto with_spread = moesnap::RecoveryProbabilities(spread, experts);
        py::list recovery;
        for (size_t f = 0; f < with_overlap.size(); ++f) {
          py::dict row;
          row["failed"] = with_overlap[f].failed;
          row["overlap"] = with_overlap[f].probability;
          row["overlap_interval"] = py::make_tuple(with_overlap[f].low, with_overlap[f].high);
          row["spread"] = with_spread[f].probability;
          row["exact"] = with_overlap[f].exact;
          recovery.append(row);
        }
        py::dict result;
        result["replicas"] = replicas;
        result["placement"] = overlap;
        result["spread_placement"] = spread;
        result["recovery"] = recovery;
        result["reconfiguration"] = py::none();
        if (!failed.empty()) {
          result["reconfiguration"] =
              ReconfigurationDict(Value(moesnap::Reconfigure(loads, options, overlap, failed)));
        }
        return result;
      },
      "Expert replica allocation, maximum-rank-overlap placement, recovery probability per number "
      "of failed nodes (beside a spread placement) and, with `failed`, the transfers onto the "
      "survivors ('from' None: from the snapshot cluster).",
      py::arg("loads"), py::arg("nodes"), py::arg("slots"), py::arg("min_replicas") = 1,
      py::arg("failed") = std::vector<int>{});

  module.def(
      "reconfigure",
      [](const std::vector<double>& loads, int nodes, int slots, int min_replicas,
         const moesnap::Placement& current, const std::vector<int>& failed,
         const std::vector<uint64_t>& expert_bytes) {
        const moesnap::PlanOptions options{nodes, slots, min_replicas};
        return ReconfigurationDict(
            Value(moesnap::Reconfigure(loads, options, current, failed, expert_bytes)));
      },
      "The reconfiguration of placement `current` (a list per node) once `failed` nodes are gone "
      "(every node that is gone, earlier losses too): the allocation over the survivors, the new "
      "placement and the transfers onto them ('from' None: no survivor holds the expert).",
      py::arg("loads"), py::arg("nodes"), py::arg("slots"), py::arg("min_replicas"),
      py::arg("current"), py::arg("failed"), py::arg("expert_bytes") = std::vector<uint64_t>{});

  module.def(
      "recovery_probabilities",
      [](const moesnap::Placement& placement, int experts) {
        py::list rows;
        for (const moesnap::RecoveryProbability& row :
             moesnap::RecoveryProbabilities(placement, experts)) {
          py::dict converted;
          converted["failed"] = row.failed;
          converted["probability"] = row.probability;
          converted["interval"] = py::make_tuple(row.low, row.high);
          converted["exact"] = row.exact;
          rows.append(converted);
        }
        return rows;
      },
      "For 0..N failed nodes of `placement` (experts per node), chosen uniformly: the probability "
      "that every one of `experts` experts keeps a replica (exact over node subsets while they "
      "are few, else sampled with a 95% interval).",
      py::arg("placement"), py::arg("experts"));
}
