// The daemon's Unix-socket gRPC endpoints with access control. gRPC cannot tell a handler who is on
// the other end of a Unix socket, so the daemon accepts connections itself, reads the peer's
// credentials (SO_PEERCRED), and hands each connection to one of two gRPC servers: the real one for
// allowed peers, and one that answers every call with PERMISSION_DENIED and the rule it applied.
#ifndef MOESNAP_DAEMON_UNIX_SERVER_H_
#define MOESNAP_DAEMON_UNIX_SERVER_H_

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/config.h"

namespace moesnap::daemon {

// Who may connect: the daemon's own uid, root, members of the configured group, listed uids.
class AccessPolicy {
 public:
  // `group_key` names the config key of the group in errors.
  static absl::StatusOr<AccessPolicy> FromOptions(const AccessOptions& options,
                                                  const std::string& group_key);
  bool Allows(uid_t uid, gid_t gid) const;
  std::optional<gid_t> group() const { return group_; }
  bool lists_uids() const { return !allowed_uids_.empty(); }
  std::string Describe() const;  // the rule, for refusals and logs

 private:
  std::optional<gid_t> group_;
  std::string group_name_;
  std::vector<uid_t> allowed_uids_;
};

// The credentials of the connections handed to gRPC, so that a handler can tell who calls: gRPC
// names a connection it was handed by descriptor "fd:<n>" (ServerContext::peer()). A descriptor
// number is reused only once gRPC closed its connection, after the connection's last call, and
// the accept that reuses it records the new peer before that connection's first call.
// Thread-safe.
class ConnectionPeers {
 public:
  void Record(int fd, const ucred& peer);
  // NOT_FOUND when the call did not come through a connection the UnixServer accepted.
  absl::StatusOr<ucred> Of(const grpc::ServerContext& context) const;

 private:
  mutable absl::Mutex mutex_;
  std::map<int, ucred> by_fd_ ABSL_GUARDED_BY(mutex_);
};

// Takes the connections of an endpoint that does not speak gRPC (the memory handoff).
class ConnectionHandler {
 public:
  virtual ~ConnectionHandler() = default;
  // Owns `connection` (non-blocking, close-on-exec) from now on; `peer` passed the access policy.
  virtual void Adopt(int connection, const ucred& peer) = 0;
};

// Not thread-safe to construct or stop; serves from its own accept thread.
class UnixServer {
 public:
  // Either a gRPC service (a stream socket) or a handler of raw connections (a SOCK_SEQPACKET
  // socket, so that each message arrives whole with the descriptors it carries).
  struct Endpoint {
    std::string path;
    grpc::Service* service = nullptr;
    ConnectionHandler* handler = nullptr;
    AccessPolicy policy;  // who may connect to this socket
    // With a service: the most threads its server runs at once, gRPC's waiting poller among them
    // (at least 2). A call beyond them is refused RESOURCE_EXHAUSTED at once.
    int max_threads = 0;
  };

  // Binds every endpoint's socket (mode 0660 and its policy's group; 0666 when the policy lists
  // uids, which the credential check then admits by name), refusing a path another live daemon
  // serves. Connections wait in the backlog until Serve. The peers of gRPC connections are
  // recorded in `peers`.
  static absl::StatusOr<std::unique_ptr<UnixServer>> Bind(std::vector<Endpoint> endpoints,
                                                          ConnectionPeers* peers);
  // Starts serving, once. Each gRPC endpoint has its own server: a call reaches only the service
  // of the socket it came in on.
  absl::Status Serve();
  ~UnixServer();  // stops accepting, shuts the servers down, removes the socket files

  // What the standard gRPC health service (grpc.health.v1.Health, served on every endpoint to
  // allowed peers) answers: SERVING or NOT_SERVING. NOT_SERVING until first told otherwise.
  void SetServing(bool serving);

 private:
  UnixServer() = default;
  void AcceptLoop();

  // Per listener: its endpoint, its gRPC server (null for raw endpoints), and the server that
  // refuses peers its policy does not admit, saying which rule it applied.
  struct Listener {
    Endpoint endpoint;
    int fd = -1;
    std::unique_ptr<grpc::Server> server;
    std::unique_ptr<grpc::CallbackGenericService> refusal_service;
    std::unique_ptr<grpc::Server> refusal_server;
  };

  std::vector<Listener> listeners_;
  ConnectionPeers* peers_ = nullptr;
  int wake_pipe_[2] = {-1, -1};
  std::thread accept_thread_;
};

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_UNIX_SERVER_H_
