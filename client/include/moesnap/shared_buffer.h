// Host memory a trainer shares with its node's moesnapd: an anonymous shared-memory file (memfd)
// mapped into the trainer. Tensors allocated here are snapshotted by the daemon with no copy
// through a socket, and restored by the daemon writing straight into them. The file has no name:
// the client hands its descriptor to the daemon (Client::RegisterHostRegion does), and the memory
// is gone when both let go of it, so a trainer that crashes leaves nothing behind.
//
// Pages: ordinary ones, or the host's huge pages (hugetlbfs, 2 MiB on x86-64) where the trainer
// asks for them (MOESNAP_HUGE_PAGES=1, or Pages::kHuge) and the operator reserved them
// (vm.nr_hugepages; a Kubernetes pod's hugepages-2Mi). A page's first access through a new mapping
// costs a fault, 5-12 us on virtual machines, so a fresh process restoring a GiB into ordinary
// pages spends most of its restore on faults; in huge pages it pays 512 times fewer. A file in
// huge pages is sized in whole pages, so huge pages are used only where that adds at most an
// eighth to the bytes asked for, and never where too few are free: the buffer then falls back to
// ordinary pages (page_bytes() says which it got; the daemon's metrics count both). The buffer's
// size() is the bytes asked for either way, so that a region registered over it has the same size
// whichever pages a process got; the file and its mapping are whole pages (file_bytes()).
//
// Ownership: a SharedBuffer owns its mapping and its descriptor. The file is sealed against
// shrinking and growing (and reserved at once), so the daemon reading it never faults; a trainer
// that punched a hole in a huge-page file with no free huge pages left could make it fault, which
// its guarded copies turn into an error. Thread safety: the bytes are the caller's to synchronize;
// the object itself is immutable.
#ifndef MOESNAP_CLIENT_SHARED_BUFFER_H_
#define MOESNAP_CLIENT_SHARED_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace moesnap {

class SharedBuffer {
 public:
  static constexpr const char* kRegionFile = "moesnap-region";  // the files regions live in
  // The environment variable that asks for huge pages: 1 (where they are to be had), 0 or unset.
  static constexpr const char* kHugePagesVariable = "MOESNAP_HUGE_PAGES";
  enum class Pages {
    kFromEnvironment,  // kHuge when MOESNAP_HUGE_PAGES is 1, kOrdinary when it is 0 or unset
    kOrdinary,
    kHuge,  // huge pages where they are free and worth it (see above), else ordinary ones
  };
  // Maps `bytes` of zeroed shared memory (a file of whole pages in huge pages), reserved now (a
  // full system is an error here, not a fault on first write). `name` is the file's in /proc
  // (memfd_create's), for whoever reads a trainer's open files. INVALID_ARGUMENT when
  // MOESNAP_HUGE_PAGES is set to anything else than 0 or 1.
  static absl::StatusOr<std::shared_ptr<SharedBuffer>> Allocate(
      size_t bytes, const char* name = kRegionFile, Pages pages = Pages::kFromEnvironment);
  // Maps the whole of an existing shared-memory file holding `bytes` (one Client::AdoptMemory
  // handed back): INVALID_ARGUMENT when it is smaller. Owns `fd` once mapped (the caller keeps it
  // on failure).
  static absl::StatusOr<std::shared_ptr<SharedBuffer>> Map(int fd, size_t bytes);
  // The same file, unmapped, for a caller that maps it itself (the Python package maps it with
  // mmap): it must map the file's whole size (fstat), since a mapping of huge pages is unmapped
  // in whole pages only. The caller owns the descriptor.
  static absl::StatusOr<int> CreateFile(size_t bytes, const char* name = kRegionFile,
                                        Pages pages = Pages::kFromEnvironment);
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  uint8_t* data() const;
  size_t size() const;  // the bytes asked for
  // The file's bytes, all mapped: size() rounded up to whole pages in huge pages.
  size_t file_bytes() const;
  // The size of the file's pages: the system's page, or the huge page it is made of.
  size_t page_bytes() const;
  // The file's descriptor, which registration hands to the daemon; owned by this object.
  int fd() const;

 private:
  struct State;
  explicit SharedBuffer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace moesnap

#endif  // MOESNAP_CLIENT_SHARED_BUFFER_H_
