// The C ABI (moesnap/moesnap.h) over the C++ client: arguments checked and converted, the C++ call
// made, its absl::Status turned into a code and this thread's message. Nothing else happens here.
#include "moesnap/moesnap.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json_text.h"
#include "moesnap/client.h"
#include "moesnap/placement_planner.h"
#include "moesnap/shared_buffer.h"
#include "moesnap/sparse_schedule.h"

struct moesnap_client {
  std::unique_ptr<moesnap::Client> client;
};

struct moesnap_schedule {
  moesnap::SparseSchedule schedule;
};

struct moesnap_log_messages {
  std::vector<moesnap::LoggedMessage> messages;
};

namespace {

thread_local std::string last_error;

moesnap_status Fail(const absl::Status& status) {
  last_error = std::string(status.message());
  return static_cast<moesnap_status>(status.code());
}

moesnap_status Return(const absl::Status& status) {
  return status.ok() ? MOESNAP_OK : Fail(status);
}

moesnap_status Missing(const char* what) {
  return Fail(absl::InvalidArgumentError(absl::StrCat(what, " is NULL")));
}

// Runs `body`, which returns a moesnap_status, so that no exception leaves the C ABI.
template <typename Body>
moesnap_status Guarded(Body body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Fail(absl::ResourceExhaustedError("out of memory"));
  } catch (const std::exception& error) {
    return Fail(absl::InternalError(absl::StrCat("unexpected error: ", error.what())));
  } catch (...) {
    return Fail(absl::InternalError("unexpected error"));
  }
}

// Strings in, checked: an array of `count` non-NULL strings.
absl::StatusOr<std::vector<std::string>> Strings(const char* const* strings, size_t count,
                                                 const char* what) {
  if (count > 0 && strings == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is NULL but its count is ", count));
  }
  std::vector<std::string> converted;
  converted.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    if (strings[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(what, "[", i, "] is NULL"));
    }
    converted.emplace_back(strings[i]);
  }
  return converted;
}

template <typename T>
absl::Status CheckArray(const T* array, size_t count, const char* what) {
  if (count > 0 && array == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is NULL but its count is ", count));
  }
  return absl::OkStatus();
}

std::vector<int64_t> Shape(const int64_t* shape, size_t length) {
  return length == 0 ? std::vector<int64_t>{} : std::vector<int64_t>(shape, shape + length);
}

// The name, dtype and shape of regions[i] (a moesnap_host_region or moesnap_device_region),
// checked.
template <typename Region>
absl::StatusOr<moesnap::RegionInfo> InfoOf(const Region& region, size_t i) {
  if (region.name == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("regions[", i, "].name is NULL"));
  }
  if (region.shape_length > 0 && region.shape == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region '", region.name, "': shape is NULL but has ", region.shape_length, " dimensions"));
  }
  return moesnap::RegionInfo{region.name, region.dtype != nullptr ? region.dtype : "",
                             Shape(region.shape, region.shape_length)};
}

absl::StatusOr<std::chrono::milliseconds> Timeout(double seconds, const char* what) {
  // Up to a year: anything longer is a mistake, and the milliseconds must fit.
  if (!std::isfinite(seconds) || seconds <= 0 || seconds > 365.0 * 24 * 3600) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be a positive number of seconds (at most a year), not ",
                     seconds));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

absl::StatusOr<moesnap::LogDirection> Direction(int32_t direction) {
  if (direction == MOESNAP_LOG_FORWARD) return moesnap::LogDirection::kForward;
  if (direction == MOESNAP_LOG_BACKWARD) return moesnap::LogDirection::kBackward;
  return absl::InvalidArgumentError(absl::StrCat(
      "a log direction is MOESNAP_LOG_FORWARD (0) or MOESNAP_LOG_BACKWARD (1), not ", direction));
}

// A string for the caller, released with moesnap_free.
char* Copy(const std::string& text) {
  char* copy = static_cast<char*>(std::malloc(text.size() + 1));
  if (copy == nullptr) throw std::bad_alloc();
  std::memcpy(copy, text.data(), text.size() + 1);
  return copy;
}

void Fill(const moesnap::RestoreResult& result, moesnap_restored* restored) {
  *restored = moesnap_restored{};
  restored->step = result.step;
  for (const moesnap::RestoredRegion& region : result.regions) {
    ++restored->regions;
    restored->bytes += region.bytes;
  }
  restored->tier =
      result.tier == moesnap::RestoreTier::kDurable ? MOESNAP_TIER_DURABLE : MOESNAP_TIER_MEMORY;
  restored->decoded = result.decoded ? 1 : 0;
  restored->source_node = result.source_node ? static_cast<int64_t>(*result.source_node) : -1;
}

// JSON of the planner's and the client's structured results.
template <typename T>
std::string JsonList(const std::vector<T>& values) {
  return absl::StrCat("[", absl::StrJoin(values, ","), "]");
}

std::string JsonStrings(const std::vector<std::string>& values) {
  std::vector<std::string> quoted;
  for (const std::string& value : values) quoted.push_back(moesnap::JsonString(value));
  return JsonList(quoted);
}

std::string JsonPlacement(const moesnap::Placement& placement) {
  std::vector<std::string> nodes;
  for (const std::vector<int>& node : placement) nodes.push_back(JsonList(node));
  return JsonList(nodes);
}

std::string JsonReconfiguration(const moesnap::Reconfiguration& plan) {
  std::vector<std::string> transfers;
  for (const moesnap::Transfer& transfer : plan.transfers) {
    transfers.push_back(absl::StrCat(
        "{\"expert\":", transfer.expert, ",\"from\":",
        transfer.from ? absl::StrCat(*transfer.from) : "null", ",\"to\":", transfer.to,
        ",\"bytes\":", transfer.bytes, "}"));
  }
  return absl::StrCat("{\"survivors\":", JsonList(plan.survivors),
                      ",\"replicas\":", JsonList(plan.replicas),
                      ",\"placement\":", JsonPlacement(plan.placement),
                      ",\"transfers\":", JsonList(transfers),
                      ",\"bytes_moved\":", plan.bytes_moved, "}");
}

std::string JsonWindow(const std::optional<moesnap::SparseWindow>& window) {
  if (!window) return "null";
  std::vector<std::string> slots;
  for (const moesnap::WindowSlotState& slot : window->slots) {
    slots.push_back(absl::StrCat("{\"slot\":", slot.slot, ",\"step\":", slot.step,
                                 ",\"committed\":", slot.committed ? "true" : "false",
                                 ",\"operators\":", JsonStrings(slot.operators), "}"));
  }
  return absl::StrCat("{\"first_step\":", window->first_step, ",\"size\":", window->size,
                      ",\"buffer\":", window->buffer, ",\"slots\":", JsonList(slots),
                      ",\"failure\":", moesnap::JsonString(window->failure), "}");
}

// A placement from the C struct, every expert checked against `experts`.
absl::StatusOr<moesnap::Placement> ToPlacement(const moesnap_placement* placement,
                                               size_t experts) {
  if (placement == nullptr) return absl::InvalidArgumentError("placement is NULL");
  if (placement->node_count > 0 && placement->offsets == nullptr) {
    return absl::InvalidArgumentError("placement offsets are NULL");
  }
  moesnap::Placement converted(placement->node_count);
  if (placement->node_count == 0) return converted;
  if (placement->offsets[0] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("placement offsets start at ", placement->offsets[0], ", not 0"));
  }
  for (size_t node = 0; node < placement->node_count; ++node) {
    const size_t begin = placement->offsets[node], end = placement->offsets[node + 1];
    if (end < begin) {
      return absl::InvalidArgumentError(absl::StrCat("placement offsets decrease at node ", node));
    }
    if (end > begin && placement->experts == nullptr) {
      return absl::InvalidArgumentError("placement experts are NULL");
    }
    for (size_t i = begin; i < end; ++i) {
      const int32_t expert = placement->experts[i];
      if (expert < 0 || static_cast<size_t>(expert) >= experts) {
        return absl::InvalidArgumentError(absl::StrCat("node ", node, " holds expert ", expert,
                                                       ", not one of the ", experts, " experts"));
      }
      converted[node].push_back(expert);
    }
  }
  return converted;
}

}  // namespace

extern "C" {

uint32_t moesnap_abi_version(void) { return MOESNAP_C_ABI_VERSION; }

const char* moesnap_version(void) { return MOESNAP_VERSION; }

const char* moesnap_status_name(moesnap_status status) {
  // absl's names ("NOT_FOUND") for its codes, "UNKNOWN" for any other number.
  static const std::vector<std::string>* const names = [] {
    auto* table = new std::vector<std::string>;
    for (int code = 0; code <= static_cast<int>(absl::StatusCode::kUnauthenticated); ++code) {
      table->push_back(absl::StatusCodeToString(static_cast<absl::StatusCode>(code)));
    }
    return table;
  }();
  if (status < 0 || static_cast<size_t>(status) >= names->size()) return "UNKNOWN";
  return (*names)[status].c_str();
}

const char* moesnap_last_error(void) { return last_error.c_str(); }

void moesnap_free(void* pointer) { std::free(pointer); }

moesnap_status moesnap_shared_memory_create(size_t bytes, int* fd) {
  return Guarded([&] {
    if (fd == nullptr) return Missing("fd");
    absl::StatusOr<int> created = moesnap::SharedBuffer::CreateFile(bytes);
    if (!created.ok()) return Fail(created.status());
    *fd = *created;
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_client_connect(const char* socket_path, int64_t rank,
                                      double call_timeout_s, double wait_timeout_s,
                                      moesnap_client** client) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    absl::StatusOr<moesnap::ClientOptions> options = moesnap::ClientOptions::FromEnvironment();
    if (!options.ok()) return Fail(options.status());
    if (socket_path != nullptr) options->socket_path = socket_path;
    if (rank >= 0) {
      if (rank > UINT32_MAX) {
        return Fail(absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is out of range")));
      }
      options->rank = static_cast<uint32_t>(rank);
    }
    absl::StatusOr<std::chrono::milliseconds> call = Timeout(call_timeout_s, "call_timeout_s");
    if (!call.ok()) return Fail(call.status());
    absl::StatusOr<std::chrono::milliseconds> wait = Timeout(wait_timeout_s, "wait_timeout_s");
    if (!wait.ok()) return Fail(wait.status());
    options->call_timeout = *call;
    options->wait_timeout = *wait;
    absl::StatusOr<std::unique_ptr<moesnap::Client>> connected = moesnap::Client::Connect(*options);
    if (!connected.ok()) return Fail(connected.status());
    *client = new moesnap_client{*std::move(connected)};
    return MOESNAP_OK;
  });
}

void moesnap_client_close(moesnap_client* client) { delete client; }

uint32_t moesnap_client_rank(const moesnap_client* client) { return client->client->rank(); }

uint32_t moesnap_client_node_id(const moesnap_client* client) {
  return client->client->node_id();
}

moesnap_status moesnap_client_share_memory(moesnap_client* client, const int* fds, size_t count,
                                           uint64_t* handles) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (absl::Status status = CheckArray(fds, count, "fds"); !status.ok()) return Fail(status);
    if (absl::Status status = CheckArray(handles, count, "handles"); !status.ok()) {
      return Fail(status);
    }
    absl::StatusOr<std::vector<moesnap::MemoryHandle>> shared =
        client->client->ShareMemory(std::vector<int>(fds, fds + count));
    if (!shared.ok()) return Fail(shared.status());
    std::copy(shared->begin(), shared->end(), handles);
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_client_adopt_memory(moesnap_client* client, size_t bytes, int* fd,
                                           uint64_t* handle) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (fd == nullptr) return Missing("fd");
    if (handle == nullptr) return Missing("handle");
    *fd = -1;
    *handle = 0;
    absl::StatusOr<std::optional<moesnap::AdoptedMemory>> adopted =
        client->client->AdoptMemory(bytes);
    if (!adopted.ok()) return Fail(adopted.status());
    if (adopted->has_value()) {
      *fd = (*adopted)->fd;
      *handle = (*adopted)->memory;
    }
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_client_register_host_regions(moesnap_client* client,
                                                    const moesnap_host_region* regions,
                                                    size_t count) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (absl::Status status = CheckArray(regions, count, "regions"); !status.ok()) {
      return Fail(status);
    }
    std::vector<moesnap::HostRegion> converted;
    converted.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      absl::StatusOr<moesnap::RegionInfo> info = InfoOf(regions[i], i);
      if (!info.ok()) return Fail(info.status());
      converted.push_back(
          {*std::move(info), regions[i].memory, regions[i].offset, regions[i].bytes});
    }
    return Return(client->client->RegisterHostRegions(converted));
  });
}

moesnap_status moesnap_client_register_device_regions(moesnap_client* client,
                                                      const moesnap_device_region* regions,
                                                      size_t count) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (absl::Status status = CheckArray(regions, count, "regions"); !status.ok()) {
      return Fail(status);
    }
    std::vector<moesnap::DeviceRegion> converted;
    converted.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      const moesnap_device_region& region = regions[i];
      absl::StatusOr<moesnap::RegionInfo> info = InfoOf(region, i);
      if (!info.ok()) return Fail(info.status());
      converted.push_back({*std::move(info),
                           {region.device, reinterpret_cast<void*>(region.address), region.bytes,
                            reinterpret_cast<void*>(region.stream)}});
    }
    return Return(client->client->RegisterDeviceRegions(converted));
  });
}

moesnap_status moesnap_client_set_replica_group(moesnap_client* client, const char* name,
                                                const uint32_t* ranks, size_t rank_count,
                                                const char* const* regions, size_t count) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (name == nullptr) return Missing("name");
    if (absl::Status status = CheckArray(ranks, rank_count, "ranks"); !status.ok()) {
      return Fail(status);
    }
    absl::StatusOr<std::vector<std::string>> names = Strings(regions, count, "regions");
    if (!names.ok()) return Fail(names.status());
    moesnap::ReplicaGroup group{name, {}};
    if (rank_count > 0) group.ranks.assign(ranks, ranks + rank_count);
    return Return(client->client->SetReplicaGroup(group, *names));
  });
}

moesnap_status moesnap_client_snapshot(moesnap_client* client, int64_t step,
                                       const char* const* regions, size_t count, uint64_t* bytes) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    absl::StatusOr<std::vector<std::string>> names = Strings(regions, count, "regions");
    if (!names.ok()) return Fail(names.status());
    absl::StatusOr<uint64_t> copied = client->client->Snapshot(step, *names);
    if (!copied.ok()) return Fail(copied.status());
    if (bytes != nullptr) *bytes = *copied;
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_client_snapshot_sparse(moesnap_client* client, int64_t step,
                                              const char* const* regions, size_t count,
                                              const moesnap_sparse_slot* slot, uint64_t* bytes) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (slot == nullptr) return Missing("slot");
    absl::StatusOr<std::vector<std::string>> names = Strings(regions, count, "regions");
    if (!names.ok()) return Fail(names.status());
    absl::StatusOr<std::vector<std::string>> operators =
        Strings(slot->operators, slot->operator_count, "slot operators");
    if (!operators.ok()) return Fail(operators.status());
    const moesnap::SparseSlot sparse{slot->window_first_step, slot->window_size, slot->slot,
                                     slot->buffer, *std::move(operators)};
    absl::StatusOr<uint64_t> copied = client->client->SnapshotSparse(step, *names, sparse);
    if (!copied.ok()) return Fail(copied.status());
    if (bytes != nullptr) *bytes = *copied;
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_client_wait_captured(moesnap_client* client, int64_t step) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    return Return(client->client->WaitCaptured(step));
  });
}

moesnap_status moesnap_client_wait_committed(moesnap_client* client, int64_t step) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    return Return(client->client->WaitCommitted(step));
  });
}

moesnap_status moesnap_client_commit(moesnap_client* client, int64_t step) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    return Return(client->client->Commit(step));
  });
}

moesnap_status moesnap_client_restore(moesnap_client* client, int32_t has_step, int64_t step,
                                      const char* const* regions, size_t count,
                                      moesnap_restored* restored) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (restored == nullptr) return Missing("restored");
    absl::StatusOr<std::vector<std::string>> names = Strings(regions, count, "regions");
    if (!names.ok()) return Fail(names.status());
    absl::StatusOr<moesnap::RestoreResult> result = client->client->Restore(
        has_step ? std::optional<int64_t>(step) : std::nullopt, *names);
    if (!result.ok()) return Fail(result.status());
    Fill(*result, restored);
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_client_restore_from(moesnap_client* client, uint32_t source_rank,
                                           const char* const* regions, size_t count,
                                           moesnap_restored* restored) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (restored == nullptr) return Missing("restored");
    absl::StatusOr<std::vector<std::string>> names = Strings(regions, count, "regions");
    if (!names.ok()) return Fail(names.status());
    absl::StatusOr<moesnap::RestoreResult> result =
        client->client->RestoreFrom(source_rank, *names);
    if (!result.ok()) return Fail(result.status());
    Fill(*result, restored);
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_client_latest_committed(moesnap_client* client, int32_t* has_step,
                                               int64_t* step) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (has_step == nullptr || step == nullptr) return Missing("has_step or step");
    absl::StatusOr<std::optional<int64_t>> latest = client->client->LatestCommitted();
    if (!latest.ok()) return Fail(latest.status());
    *has_step = latest->has_value() ? 1 : 0;
    *step = latest->value_or(0);
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_client_windows(moesnap_client* client, char** json) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (json == nullptr) return Missing("json");
    absl::StatusOr<moesnap::SparseWindows> windows = client->client->Windows();
    if (!windows.ok()) return Fail(windows.status());
    *json = Copy(absl::StrCat("{\"committed\":", JsonWindow(windows->committed),
                              ",\"open\":", JsonWindow(windows->open), "}"));
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_client_take_skipped_steps(moesnap_client* client, char** json) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (json == nullptr) return Missing("json");
    std::vector<std::string> steps;
    for (const auto& [step, reason] : client->client->TakeSkippedSteps()) {
      steps.push_back(absl::StrCat("[", step, ",", moesnap::JsonString(reason), "]"));
    }
    *json = Copy(JsonList(steps));
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_client_reconnect(moesnap_client* client) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    return Return(client->client->Reconnect());
  });
}

moesnap_status moesnap_client_append_log(moesnap_client* client, int64_t step,
                                         uint32_t micro_batch, int32_t direction,
                                         uint32_t peer_rank, const void* payload,
                                         size_t payload_bytes) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (payload == nullptr && payload_bytes > 0) return Missing("payload");
    absl::StatusOr<moesnap::LogDirection> parsed = Direction(direction);
    if (!parsed.ok()) return Fail(parsed.status());
    const std::string_view bytes(static_cast<const char*>(payload), payload_bytes);
    return Return(client->client->AppendLog(step, micro_batch, *parsed, peer_rank, bytes));
  });
}

moesnap_status moesnap_client_fetch_log(moesnap_client* client, uint32_t sender_rank, int64_t step,
                                        int32_t direction, uint32_t peer_rank,
                                        moesnap_log_messages** messages) {
  return Guarded([&] {
    if (client == nullptr) return Missing("client");
    if (messages == nullptr) return Missing("messages");
    absl::StatusOr<moesnap::LogDirection> parsed = Direction(direction);
    if (!parsed.ok()) return Fail(parsed.status());
    absl::StatusOr<std::vector<moesnap::LoggedMessage>> fetched =
        client->client->FetchLog(sender_rank, step, *parsed, peer_rank);
    if (!fetched.ok()) return Fail(fetched.status());
    *messages = new moesnap_log_messages{*std::move(fetched)};
    return MOESNAP_OK;
  });
}

size_t moesnap_log_messages_count(const moesnap_log_messages* messages) {
  return messages->messages.size();
}

uint32_t moesnap_log_messages_micro_batch(const moesnap_log_messages* messages, size_t index) {
  return index < messages->messages.size() ? messages->messages[index].micro_batch : 0;
}

const void* moesnap_log_messages_payload(const moesnap_log_messages* messages, size_t index,
                                         size_t* payload_bytes) {
  if (index >= messages->messages.size()) {
    *payload_bytes = 0;
    return nullptr;
  }
  const std::string& payload = messages->messages[index].payload;
  *payload_bytes = payload.size();
  return payload.data();
}

void moesnap_log_messages_free(moesnap_log_messages* messages) { delete messages; }

moesnap_status moesnap_schedule_build(const moesnap_operator* operators, size_t count,
                                      double iteration_seconds, double copy_bytes_per_second,
                                      uint64_t every_step_bytes, moesnap_schedule** schedule) {
  return Guarded([&] {
    if (schedule == nullptr) return Missing("schedule");
    if (absl::Status status = CheckArray(operators, count, "operators"); !status.ok()) {
      return Fail(status);
    }
    std::vector<moesnap::Operator> converted;
    converted.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      if (operators[i].name == nullptr) {
        return Fail(absl::InvalidArgumentError(absl::StrCat("operators[", i, "].name is NULL")));
      }
      converted.push_back({operators[i].name, operators[i].is_expert != 0,
                           operators[i].full_state_bytes, operators[i].weight_bytes,
                           operators[i].token_count});
    }
    moesnap::ScheduleOptions options;
    options.iteration_seconds = iteration_seconds;
    options.copy_bytes_per_second = copy_bytes_per_second;
    options.every_step_bytes = every_step_bytes;
    absl::StatusOr<moesnap::SparseSchedule> built =
        moesnap::SparseSchedule::Build(converted, options);
    if (!built.ok()) return Fail(built.status());
    *schedule = new moesnap_schedule{*std::move(built)};
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_schedule_with_window(const moesnap_schedule* schedule, int32_t window,
                                            moesnap_schedule** widened) {
  return Guarded([&] {
    if (schedule == nullptr || widened == nullptr) return Missing("schedule or widened");
    absl::StatusOr<moesnap::SparseSchedule> result = schedule->schedule.WithWindow(window);
    if (!result.ok()) return Fail(result.status());
    *widened = new moesnap_schedule{*std::move(result)};
    return MOESNAP_OK;
  });
}

void moesnap_schedule_free(moesnap_schedule* schedule) { delete schedule; }

int32_t moesnap_schedule_agreed_window(const int32_t* windows, size_t count) {
  if (windows == nullptr) return 0;
  return moesnap::SparseSchedule::AgreedWindow(std::vector<int>(windows, windows + count));
}

int32_t moesnap_schedule_window(const moesnap_schedule* schedule) {
  return schedule->schedule.window();
}

uint64_t moesnap_schedule_budget_bytes(const moesnap_schedule* schedule) {
  return schedule->schedule.budget_bytes();
}

size_t moesnap_schedule_operator_count(const moesnap_schedule* schedule) {
  return schedule->schedule.order().size();
}

void moesnap_schedule_order(const moesnap_schedule* schedule, int32_t* order) {
  std::copy(schedule->schedule.order().begin(), schedule->schedule.order().end(), order);
}

int32_t moesnap_schedule_slot_of_step(const moesnap_schedule* schedule, int64_t step) {
  return schedule->schedule.SlotOfStep(step);
}

moesnap_status moesnap_schedule_slot(const moesnap_schedule* schedule, int32_t slot,
                                     uint64_t* bytes, int32_t* captured, size_t* captured_count) {
  return Guarded([&] {
    if (schedule == nullptr || bytes == nullptr || captured == nullptr ||
        captured_count == nullptr) {
      return Missing("schedule, bytes, captured or captured_count");
    }
    const std::vector<moesnap::Slot>& slots = schedule->schedule.slots();
    if (slot < 0 || static_cast<size_t>(slot) >= slots.size()) {
      return Fail(absl::OutOfRangeError(
          absl::StrCat("slot ", slot, " is not in [0, ", slots.size(), ")")));
    }
    *bytes = slots[slot].bytes;
    std::copy(slots[slot].captured.begin(), slots[slot].captured.end(), captured);
    *captured_count = slots[slot].captured.size();
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_schedule_captured_by(const moesnap_schedule* schedule,
                                            int32_t operator_index, int32_t slot,
                                            int32_t* captured) {
  return Guarded([&] {
    if (schedule == nullptr || captured == nullptr) return Missing("schedule or captured");
    const size_t operators = schedule->schedule.order().size();
    if (operator_index < 0 || static_cast<size_t>(operator_index) >= operators) {
      return Fail(absl::OutOfRangeError(
          absl::StrCat("operator ", operator_index, " is not in [0, ", operators, ")")));
    }
    *captured = schedule->schedule.CapturedBy(operator_index, slot) ? 1 : 0;
    return MOESNAP_OK;
  });
}

int32_t moesnap_schedule_needs_reorder(const moesnap_schedule* schedule,
                                       const double* token_counts, size_t count) {
  if (token_counts == nullptr) count = 0;
  return schedule->schedule.NeedsReorder(std::vector<double>(token_counts, token_counts + count))
             ? 1
             : 0;
}

int32_t moesnap_schedule_needs_regeneration(const moesnap_schedule* schedule,
                                            double iteration_seconds) {
  return schedule->schedule.NeedsRegeneration(iteration_seconds) ? 1 : 0;
}

moesnap_status moesnap_plan(const double* loads, size_t expert_count, int32_t nodes,
                            int32_t slots, int32_t min_replicas, const int32_t* failed,
                            size_t failed_count, char** json) {
  return Guarded([&] {
    if (json == nullptr) return Missing("json");
    if (absl::Status status = CheckArray(loads, expert_count, "loads"); !status.ok()) {
      return Fail(status);
    }
    if (absl::Status status = CheckArray(failed, failed_count, "failed"); !status.ok()) {
      return Fail(status);
    }
    const std::vector<double> load_list(loads, loads + expert_count);
    const moesnap::PlanOptions options{nodes, slots, min_replicas};
    absl::StatusOr<std::vector<int>> replicas = moesnap::AllocateReplicas(load_list, options);
    if (!replicas.ok()) return Fail(replicas.status());
    absl::StatusOr<moesnap::Placement> overlap = moesnap::PlaceMaximumOverlap(*replicas, options);
    if (!overlap.ok()) return Fail(overlap.status());
    absl::StatusOr<moesnap::Placement> spread = moesnap::PlaceSpread(*replicas, options);
    if (!spread.ok()) return Fail(spread.status());
    const int experts = static_cast<int>(expert_count);
    const auto with_overlap = moesnap::RecoveryProbabilities(*overlap, experts);
    const auto with_spread = moesnap::RecoveryProbabilities(*spread, experts);
    std::vector<std::string> recovery;
    for (size_t f = 0; f < with_overlap.size(); ++f) {
      recovery.push_back(absl::StrCat(
          "{\"failed\":", with_overlap[f].failed,
          ",\"overlap\":", moesnap::JsonNumber(with_overlap[f].probability),
          ",\"overlap_interval\":[", moesnap::JsonNumber(with_overlap[f].low), ",",
          moesnap::JsonNumber(with_overlap[f].high),
          "],\"spread\":", moesnap::JsonNumber(with_spread[f].probability),
          ",\"exact\":", with_overlap[f].exact ? "true" : "false", "}"));
    }
    std::string reconfiguration = "null";
    if (failed_count > 0) {
      absl::StatusOr<moesnap::Reconfiguration> planned = moesnap::Reconfigure(
          load_list, options, *overlap, std::vector<int>(failed, failed + failed_count));
      if (!planned.ok()) return Fail(planned.status());
      reconfiguration = JsonReconfiguration(*planned);
    }
    *json = Copy(absl::StrCat("{\"replicas\":", JsonList(*replicas),
                              ",\"placement\":", JsonPlacement(*overlap),
                              ",\"spread_placement\":", JsonPlacement(*spread),
                              ",\"recovery\":", JsonList(recovery),
                              ",\"reconfiguration\":", reconfiguration, "}"));
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_reconfigure(const double* loads, size_t expert_count, int32_t nodes,
                                   int32_t slots, int32_t min_replicas,
                                   const moesnap_placement* current, const int32_t* failed,
                                   size_t failed_count, const uint64_t* expert_bytes,
                                   char** json) {
  return Guarded([&] {
    if (json == nullptr) return Missing("json");
    if (absl::Status status = CheckArray(loads, expert_count, "loads"); !status.ok()) {
      return Fail(status);
    }
    if (absl::Status status = CheckArray(failed, failed_count, "failed"); !status.ok()) {
      return Fail(status);
    }
    absl::StatusOr<moesnap::Placement> placement = ToPlacement(current, expert_count);
    if (!placement.ok()) return Fail(placement.status());
    const std::vector<uint64_t> sizes =
        expert_bytes == nullptr ? std::vector<uint64_t>{}
                                : std::vector<uint64_t>(expert_bytes, expert_bytes + expert_count);
    absl::StatusOr<moesnap::Reconfiguration> planned = moesnap::Reconfigure(
        std::vector<double>(loads, loads + expert_count), {nodes, slots, min_replicas}, *placement,
        std::vector<int>(failed, failed + failed_count), sizes);
    if (!planned.ok()) return Fail(planned.status());
    *json = Copy(JsonReconfiguration(*planned));
    return MOESNAP_OK;
  });
}

moesnap_status moesnap_recovery_probabilities(const moesnap_placement* placement, int32_t experts,
                                              char** json) {
  return Guarded([&] {
    if (json == nullptr) return Missing("json");
    if (experts < 0) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(experts, " experts")));
    }
    absl::StatusOr<moesnap::Placement> converted = ToPlacement(placement, experts);
    if (!converted.ok()) return Fail(converted.status());
    std::vector<std::string> rows;
    for (const moesnap::RecoveryProbability& row :
         moesnap::RecoveryProbabilities(*converted, experts)) {
      rows.push_back(absl::StrCat(
          "{\"failed\":", row.failed, ",\"probability\":", moesnap::JsonNumber(row.probability),
          ",\"interval\":[", moesnap::JsonNumber(row.low), ",", moesnap::JsonNumber(row.high),
          "],\"exact\":", row.exact ? "true" : "false", "}"));
    }
    *json = Copy(JsonList(rows));
    return MOESNAP_OK;
  });
}

}  // extern "C"
