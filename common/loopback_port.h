// A TCP port on 127.0.0.1 that nothing is bound to now, for loopback clusters in tests and
// benchmarks. It is drawn at random from below the kernel's ephemeral range
// (net.ipv4.ip_local_port_range), so the kernel never hands it out itself (to a listener on port
// 0 or an outgoing connection); one process is never handed the same port twice (several ports
// picked before any is bound must differ). Another test process may draw the same port before it
// is bound, rarely; whoever binds it then fails at start and draws again.
#ifndef MOESNAP_COMMON_LOOPBACK_PORT_H_
#define MOESNAP_COMMON_LOOPBACK_PORT_H_

#include <cstdint>

namespace moesnap {

uint16_t UnusedLoopbackPort();  // 0 if none could be found

}  // namespace moesnap

#endif  // MOESNAP_COMMON_LOOPBACK_PORT_H_
