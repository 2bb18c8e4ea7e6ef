// Registers 1 MiB of host memory, snapshots it as step 1, scribbles over it, restores it and checks
// every byte; prints "restored step 1" on success. Usage: cpp_trainer AGENT_SOCKET RANK
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "moesnap/client.h"

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  auto fail = [](const absl::Status& status) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    return 1;
  };
  auto client = moesnap::Client::Connect(
      {.socket_path = argv[1], .rank = static_cast<uint32_t>(std::atoi(argv[2]))});
  if (!client.ok()) return fail(client.status());
  constexpr size_t kBytes = 1 << 20;
  auto memory = (*client)->AllocateHost(kBytes);
  if (!memory.ok()) return fail(memory.status());
  for (size_t i = 0; i < kBytes; ++i) (*memory)->data()[i] = static_cast<uint8_t>(i * 7 + 3);
  if (auto status = (*client)->RegisterHostRegion({"state", "uint8", {kBytes}}, *memory, 0, kBytes);
      !status.ok()) {
    return fail(status);
  }
  if (auto copied = (*client)->Snapshot(1); !copied.ok()) return fail(copied.status());
  if (auto status = (*client)->WaitCommitted(1); !status.ok()) return fail(status);
  std::memset((*memory)->data(), 0, kBytes);
  auto restored = (*client)->Restore();
  if (!restored.ok()) return fail(restored.status());
  for (size_t i = 0; i < kBytes; ++i) {
    if ((*memory)->data()[i] != static_cast<uint8_t>(i * 7 + 3)) {
      std::fprintf(stderr, "byte %zu differs after the restore\n", i);
      return 1;
    }
  }
  std::printf("restored step %lld\n", static_cast<long long>(restored->step));
  return 0;
}
