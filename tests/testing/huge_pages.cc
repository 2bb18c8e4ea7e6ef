// HugePageReservation: /proc/meminfo read for the free count and size, vm.nr_hugepages written.
#include "tests/testing/huge_pages.h"

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace moesnap::testing {
namespace {

constexpr char kPoolSize[] = "/proc/sys/vm/nr_hugepages";

// The number after `field` in /proc/meminfo; 0 when it is not there.
uint64_t MemInfo(const std::string& field) {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    if (line.rfind(field, 0) != 0) continue;
    std::istringstream value(line.substr(field.size()));
    uint64_t number = 0;
    value >> number;
    return number;
  }
  return 0;
}

uint64_t PoolSize() {
  std::ifstream file(kPoolSize);
  uint64_t pages = 0;
  file >> pages;
  return pages;
}

bool SetPoolSize(uint64_t pages) {
  std::ofstream file(kPoolSize);
  file << pages << "\n";
  file.flush();
  return static_cast<bool>(file);
}

}  // namespace

uint64_t HugePageReservation::PageBytes() { return MemInfo("Hugepagesize:") * 1024; }
uint64_t HugePageReservation::FreePages() {
  const uint64_t free = MemInfo("HugePages_Free:");
  const uint64_t promised = MemInfo("HugePages_Rsvd:");
  return free > promised ? free - promised : 0;
}

absl::StatusOr<std::unique_ptr<HugePageReservation>> HugePageReservation::Reserve(uint64_t pages) {
  const uint64_t free = FreePages();
  if (free >= pages) {
    return std::unique_ptr<HugePageReservation>(new HugePageReservation(UINT64_MAX));
  }
  if (PageBytes() == 0) {
    return absl::FailedPreconditionError("this kernel has no huge pages (no Hugepagesize)");
  }
  if (geteuid() != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        free, " huge pages are free, ", pages, " are needed: reserving them (vm.nr_hugepages) "
        "needs root"));
  }
  const uint64_t before = PoolSize();
  if (!SetPoolSize(before + (pages - free))) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write ", kPoolSize, " (a read-only /proc/sys, as in a container)"));
  }
  auto reservation = std::unique_ptr<HugePageReservation>(new HugePageReservation(before));
  if (FreePages() < pages) {
    return absl::FailedPreconditionError(absl::StrCat(
        "vm.nr_hugepages raised from ", before, " by ", pages - free, " left ", FreePages(),
        " huge pages free of the ", pages, " needed (memory too fragmented or short)"));
  }
  return reservation;
}

absl::StatusOr<std::unique_ptr<HugePageReservation>> HugePageReservation::ReserveForTest(
    uint64_t pages) {
  if (PageBytes() != kTestPageBytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the test's sizes are made for huge pages of ", kTestPageBytes, " bytes; this system's are ",
        PageBytes(), " bytes"));
  }
  return Reserve(pages);
}

HugePageReservation::~HugePageReservation() {
  if (restore_to_ != UINT64_MAX) SetPoolSize(restore_to_);
}

}  // namespace moesnap::testing
