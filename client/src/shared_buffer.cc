// SharedBuffer over common/SharedMemory, with names that carry the creating process's pid so the
// daemon can tell orphaned files from live ones.
#include "moesnap/shared_buffer.h"

#include <grp.h>
#include <unistd.h>

#include <atomic>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/shared_memory.h"

namespace moesnap {

struct SharedBuffer::State {
  SharedMemory memory;
};

SharedBuffer::SharedBuffer(std::unique_ptr<State> state) : state_(std::move(state)) {}

SharedBuffer::~SharedBuffer() { SharedMemory::Unlink(state_->memory.name()).IgnoreError(); }

absl::StatusOr<std::shared_ptr<SharedBuffer>> SharedBuffer::Allocate(size_t bytes,
                                                                     const std::string& group) {
  static std::atomic<uint64_t> counter{0};
  SharedMemory::CreateOptions options;
  if (!group.empty()) {
    const struct group* entry = getgrnam(group.c_str());
    if (entry == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("group '", group, "' does not exist here"));
    }
    options.group = entry->gr_gid;
  }
  // The random part keeps names unguessable; the pid part lets the daemon find orphans.
  const std::string name = RegionFileName(absl::StrCat(counter++, ".", std::random_device{}()));
  absl::StatusOr<SharedMemory> memory = SharedMemory::Create(name, bytes, options);
  if (!memory.ok()) return memory.status();
  return std::shared_ptr<SharedBuffer>(
      new SharedBuffer(std::make_unique<State>(State{*std::move(memory)})));
}

uint8_t* SharedBuffer::data() const { return state_->memory.data(); }
size_t SharedBuffer::size() const { return state_->memory.size(); }
const std::string& SharedBuffer::name() const { return state_->memory.name(); }

}  // namespace moesnap
