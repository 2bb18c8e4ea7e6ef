/* The same round trip through the C ABI: a shared-memory file mapped here, handed to the daemon,
 * snapshotted as step 1, scribbled over, restored and checked; prints "restored step 1".
 * Usage: c_trainer AGENT_SOCKET RANK */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "moesnap/moesnap.h"

static int fail(moesnap_status status) {
  fprintf(stderr, "%s: %s\n", moesnap_status_name(status), moesnap_last_error());
  return 1;
}

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  if (moesnap_abi_version() != MOESNAP_C_ABI_VERSION) return 3;
  moesnap_client* client = NULL;
  moesnap_status status = moesnap_client_connect(argv[1], atoi(argv[2]), 30, 60, &client);
  if (status != MOESNAP_OK) return fail(status);
  const size_t bytes = 1 << 20;
  int fd = -1;
  if ((status = moesnap_shared_memory_create(bytes, &fd)) != MOESNAP_OK) return fail(status);
  /* The whole file: in huge pages (MOESNAP_HUGE_PAGES=1) it is rounded up to whole ones. */
  struct stat file;
  if (fstat(fd, &file) != 0) return 4;
  unsigned char* memory =
      mmap(NULL, (size_t)file.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (memory == MAP_FAILED) return 4;
  for (size_t i = 0; i < bytes; ++i) memory[i] = (unsigned char)(i * 13 + 1);
  uint64_t handle = 0;
  if ((status = moesnap_client_share_memory(client, &fd, 1, &handle)) != MOESNAP_OK) {
    return fail(status);
  }
  const int64_t shape[] = {(int64_t)bytes};
  const moesnap_host_region region = {"state", handle, 0, bytes, "uint8", shape, 1};
  if ((status = moesnap_client_register_host_regions(client, &region, 1)) != MOESNAP_OK) {
    return fail(status);
  }
  if ((status = moesnap_client_snapshot(client, 1, NULL, 0, NULL)) != MOESNAP_OK) {
    return fail(status);
  }
  if ((status = moesnap_client_wait_committed(client, 1)) != MOESNAP_OK) return fail(status);
  memset(memory, 0, bytes);
  moesnap_restored restored;
  if ((status = moesnap_client_restore(client, 0, 0, NULL, 0, &restored)) != MOESNAP_OK) {
    return fail(status);
  }
  for (size_t i = 0; i < bytes; ++i) {
    if (memory[i] != (unsigned char)(i * 13 + 1)) {
      fprintf(stderr, "byte %zu differs after the restore\n", i);
      return 1;
    }
  }
  printf("restored step %lld\n", (long long)restored.step);
  moesnap_client_close(client);
  return 0;
}
