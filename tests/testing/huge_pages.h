// Huge pages (hugetlbfs, the system's default size) made free for a test or a benchmark: as root,
// vm.nr_hugepages is raised by what is missing and put back afterwards. Tests that reserve pages
// hold the CTest resource lock `huge_pages`, so that two never move the count at once.
#ifndef MOESNAP_TESTS_TESTING_HUGE_PAGES_H_
#define MOESNAP_TESTS_TESTING_HUGE_PAGES_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace moesnap::testing {

class HugePageReservation {
 public:
  static constexpr uint64_t kTestPageBytes = uint64_t{2} << 20;  // what tests size their files for

  // Makes at least `pages` huge pages free. FAILED_PRECONDITION, saying why, when they cannot be
  // (no huge pages, not root and too few free, vm.nr_hugepages not writable, or the kernel could
  // not find the memory).
  static absl::StatusOr<std::unique_ptr<HugePageReservation>> Reserve(uint64_t pages);
  // The same for a test whose sizes are made for kTestPageBytes: FAILED_PRECONDITION also when the
  // system's default huge page is another size.
  static absl::StatusOr<std::unique_ptr<HugePageReservation>> ReserveForTest(uint64_t pages);
  // Puts vm.nr_hugepages back (pages still in use stay until let go, as surplus pages).
  ~HugePageReservation();
  HugePageReservation(const HugePageReservation&) = delete;
  HugePageReservation& operator=(const HugePageReservation&) = delete;

  static uint64_t PageBytes();  // the default huge page size (Hugepagesize); 0 without them
  // Free and not promised to a mapping already (HugePages_Free - HugePages_Rsvd).
  static uint64_t FreePages();

 private:
  explicit HugePageReservation(uint64_t restore_to) : restore_to_(restore_to) {}
  const uint64_t restore_to_;  // vm.nr_hugepages before; UINT64_MAX when it was not moved
};

}  // namespace moesnap::testing

#endif  // MOESNAP_TESTS_TESTING_HUGE_PAGES_H_
