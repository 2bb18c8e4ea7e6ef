// A TCP port on 127.0.0.1 that nothing listens on now, for loopback clusters in tests and
// benchmarks. The kernel picks it, and one process is never handed the same port twice (several
// ports picked before any is bound must differ); another process may take it before it is used,
// which loopback tests on one machine accept.
#ifndef MOESNAP_COMMON_LOOPBACK_PORT_H_
#define MOESNAP_COMMON_LOOPBACK_PORT_H_

#include <cstdint>

namespace moesnap {

uint16_t UnusedLoopbackPort();

}  // namespace moesnap

#endif  // MOESNAP_COMMON_LOOPBACK_PORT_H_
