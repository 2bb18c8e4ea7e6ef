// UnixServer: bind with stale-socket detection, an accept loop that sorts peers by credentials, and
// the refusing generic service.
#include "daemon/unix_server.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/server_posix.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"

namespace moesnap::daemon {
namespace {

absl::StatusOr<sockaddr_un> SocketAddress(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path ", path, " is longer than ",
                                                   sizeof(address.sun_path) - 1, " bytes"));
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  return address;
}

// True when a process accepts connections on `path` now.
bool SomeoneListens(const sockaddr_un& address, int type) {
  const int probe = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (probe < 0) return false;
  const bool connected =
      connect(probe, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0;
  close(probe);
  return connected;
}

absl::StatusOr<int> BindSocket(const std::string& path, std::optional<gid_t> group, mode_t mode,
                               int type) {
  absl::StatusOr<sockaddr_un> address = SocketAddress(path);
  if (!address.ok()) return address.status();
  struct stat info {};
  if (lstat(path.c_str(), &info) == 0) {
    if (!S_ISSOCK(info.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a socket"));
    }
    if (SomeoneListens(*address, type)) {
      return absl::AlreadyExistsError(
          absl::StrCat("another moesnapd is already serving ", path, "; stop it first"));
    }
    unlink(path.c_str());  // left behind by a daemon that died
  }
  const int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(): ", std::strerror(errno)));
  // Created private, then opened to the group: no window in which others may connect.
  const mode_t old_umask = umask(0177);
  const int bound = bind(fd, reinterpret_cast<const sockaddr*>(&*address), sizeof(*address));
  const int bind_error = errno;
  umask(old_umask);
  if (bound != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot bind ", path, ": ",
                                               std::strerror(bind_error)));
  }
  if ((group && chown(path.c_str(), static_cast<uid_t>(-1), *group) != 0) ||
      chmod(path.c_str(), mode) != 0 || listen(fd, 128) != 0) {
    const int error = errno;
    close(fd);
    unlink(path.c_str());
    return absl::UnavailableError(absl::StrCat("cannot set up ", path, ": ", std::strerror(error)));
  }
  return fd;
}

// Answers every call on a connection from a refused peer.
class RefusalService : public grpc::CallbackGenericService {
 public:
  explicit RefusalService(std::string message) : message_(std::move(message)) {}

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Refusal : public grpc::ServerGenericBidiReactor {
     public:
      explicit Refusal(const std::string& message) {
        Finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED, message));
      }
      void OnDone() override { delete this; }
    };
    return new Refusal(message_);
  }

 private:
  std::string message_;
};

}  // namespace

void ConnectionPeers::Record(int fd, const ucred& peer) {
  absl::MutexLock lock(&mutex_);
  by_fd_[fd] = peer;
}

absl::StatusOr<ucred> ConnectionPeers::Of(const grpc::ServerContext& context) const {
  const std::string peer = context.peer();
  int fd = -1;
  if (absl::StartsWith(peer, "fd:") && absl::SimpleAtoi(peer.substr(3), &fd)) {
    absl::MutexLock lock(&mutex_);
    if (auto found = by_fd_.find(fd); found != by_fd_.end()) return found->second;
  }
  return absl::NotFoundError(absl::StrCat("cannot tell who is calling from '", peer, "'"));
}

absl::StatusOr<AccessPolicy> AccessPolicy::FromOptions(const AccessOptions& options,
                                                       const std::string& group_key) {
  AccessPolicy policy;
  policy.allowed_uids_ = options.allowed_uids;
  if (!options.group.empty()) {
    const struct group* entry = getgrnam(options.group.c_str());
    if (entry == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(group_key, " '", options.group, "' is not a group on this machine"));
    }
    policy.group_ = entry->gr_gid;
    policy.group_name_ = options.group;
  }
  return policy;
}

bool AccessPolicy::Allows(uid_t uid, gid_t gid) const {
  if (uid == 0 || uid == geteuid()) return true;
  if (std::find(allowed_uids_.begin(), allowed_uids_.end(), uid) != allowed_uids_.end()) return true;
  if (!group_) return false;
  if (gid == *group_) return true;
  // Supplementary groups of the peer's user, as the system lists them.
  const passwd* user = getpwuid(uid);
  if (user == nullptr) return false;
  int count = 64;
  std::vector<gid_t> groups(count);
  if (getgrouplist(user->pw_name, user->pw_gid, groups.data(), &count) < 0) {
    groups.resize(count);
    getgrouplist(user->pw_name, user->pw_gid, groups.data(), &count);
  }
  groups.resize(std::max(count, 0));
  return std::find(groups.begin(), groups.end(), *group_) != groups.end();
}

std::string AccessPolicy::Describe() const {
  std::string rule = absl::StrCat("root and uid ", geteuid(), " (the daemon's own)");
  if (group_) absl::StrAppend(&rule, ", members of group '", group_name_, "'");
  if (!allowed_uids_.empty()) absl::StrAppend(&rule, ", uids ", absl::StrJoin(allowed_uids_, ","));
  return rule;
}

absl::StatusOr<std::unique_ptr<UnixServer>> UnixServer::Bind(std::vector<Endpoint> endpoints,
                                                             ConnectionPeers* peers) {
  std::unique_ptr<UnixServer> server(new UnixServer());
  server->peers_ = peers;
  for (Endpoint& endpoint : endpoints) {
    if (endpoint.service != nullptr && endpoint.max_threads < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the server of ", endpoint.path, " needs at least 2 threads (one polls for calls), got ",
          endpoint.max_threads));
    }
    // Listed uids are admitted by the credential check, whatever their groups: the file's mode
    // must not refuse them first.
    const mode_t mode = endpoint.policy.lists_uids() ? 0666 : 0660;
    absl::StatusOr<int> fd = BindSocket(endpoint.path, endpoint.policy.group(), mode,
                                        endpoint.handler ? SOCK_SEQPACKET : SOCK_STREAM);
    if (!fd.ok()) return fd.status();  // the destructor closes and removes what was bound
    Listener& listener = server->listeners_.emplace_back();
    listener.endpoint = std::move(endpoint);
    listener.fd = *fd;
  }
  if (pipe2(server->wake_pipe_, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe(): ", std::strerror(errno)));
  }
  return server;
}

absl::Status UnixServer::Serve() {
  // The health service is process-wide state in gRPC, read when a server is built: on for the real
  // servers, off for the refusing ones (which answer every call, a health check too, with
  // PERMISSION_DENIED).
  bool built = true;
  for (Listener& listener : listeners_) {
    if (listener.endpoint.service == nullptr) continue;
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.SetMaxReceiveMessageSize(64 << 20);
    builder.RegisterService(listener.endpoint.service);
    // gRPC's sync server runs each call on a thread of its own, and calls may wait long (a
    // trainer's WaitCommitted, an operator's export): without a cap one client grows the threads
    // until the process cannot make any. Every thread of the server counts against the cap, its
    // polling thread too; a poller that takes a call first reserves its replacement, and when the
    // cap leaves none it answers the call RESOURCE_EXHAUSTED itself and polls on (gRPC 1.51,
    // ThreadManager::MainWorkLoop): calls beyond the cap are refused, never queued, and the
    // server never loses its poller.
    grpc::ResourceQuota quota(absl::StrCat("moesnap ", listener.endpoint.path));
    quota.SetMaxThreads(listener.endpoint.max_threads);
    builder.SetResourceQuota(quota);
    listener.server = builder.BuildAndStart();
    grpc::EnableDefaultHealthCheckService(false);
    listener.refusal_service = std::make_unique<RefusalService>(absl::StrCat(
        "permission denied: ", listener.endpoint.path, " accepts ",
        listener.endpoint.policy.Describe(),
        "; ask the operator to add your user to the group or to the allowed uids"));
    grpc::ServerBuilder refusal_builder;
    refusal_builder.RegisterCallbackGenericService(listener.refusal_service.get());
    listener.refusal_server = refusal_builder.BuildAndStart();
    built = built && listener.server != nullptr && listener.refusal_server != nullptr;
  }
  if (!built) return absl::InternalError("cannot start the gRPC servers");
  SetServing(false);
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  return absl::OkStatus();
}

void UnixServer::SetServing(bool serving) {
  for (const Listener& listener : listeners_) {
    if (listener.server == nullptr) continue;
    if (grpc::HealthCheckServiceInterface* health = listener.server->GetHealthCheckService()) {
      health->SetServingStatus(serving);
    }
  }
}

void UnixServer::AcceptLoop() {
  // Out of descriptors or memory, accept fails while the connection stays queued and the listener
  // stays readable: the listeners then rest for kRestMs instead of spinning the loop.
  constexpr int kRestMs = 100;
  std::vector<pollfd> watched;
  for (const Listener& listener : listeners_) watched.push_back({listener.fd, POLLIN, 0});
  watched.push_back({wake_pipe_[0], POLLIN, 0});
  bool resting = false;
  bool warned = false;  // about the exhaustion that lasts now
  while (true) {
    for (size_t i = 0; i + 1 < watched.size(); ++i) watched[i].events = resting ? 0 : POLLIN;
    if (poll(watched.data(), watched.size(), resting ? kRestMs : -1) < 0) {
      if (errno == EINTR) continue;
      Log(LogLevel::kError, "poll on the daemon sockets failed: ", std::strerror(errno));
      return;
    }
    if (watched.back().revents != 0) return;  // stopping
    resting = false;
    for (size_t i = 0; i + 1 < watched.size() && !resting; ++i) {
      if ((watched[i].revents & POLLIN) == 0) continue;
      // gRPC drives the connection from its own poller, which needs a non-blocking socket.
      const int connection = accept4(watched[i].fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (connection < 0) {
        const int error = errno;
        resting = error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM;
        if (resting && !warned) {
          Log(LogLevel::kWarning, "cannot accept connections on ", listeners_[i].endpoint.path, ": ",
              std::strerror(error), "; retrying every ", kRestMs, " ms");
          warned = true;
        }
        continue;
      }
      warned = false;
      ucred peer{};
      socklen_t length = sizeof(peer);
      if (getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0) {
        close(connection);
        continue;
      }
      Listener& listener = listeners_[i];
      const bool allowed = listener.endpoint.policy.Allows(peer.uid, peer.gid);
      if (!allowed) {
        Log(LogLevel::kWarning, "refused a connection on ", listener.endpoint.path, " from pid ",
            peer.pid, " uid ", peer.uid, " gid ", peer.gid, ": allowed are ",
            listener.endpoint.policy.Describe());
      }
      if (listener.endpoint.handler != nullptr) {
        if (allowed) {
          listener.endpoint.handler->Adopt(connection, peer);
        } else {
          close(connection);
        }
      } else if (allowed) {
        if (peers_ != nullptr) peers_->Record(connection, peer);
        grpc::AddInsecureChannelFromFd(listener.server.get(), connection);
      } else {
        grpc::AddInsecureChannelFromFd(listener.refusal_server.get(), connection);
      }
    }
  }
}

UnixServer::~UnixServer() {
  if (accept_thread_.joinable()) {
    const char stop = 1;
    if (write(wake_pipe_[1], &stop, 1) != 1) Log(LogLevel::kError, "cannot wake the accept loop");
    accept_thread_.join();
  }
  for (const Listener& listener : listeners_) {
    close(listener.fd);
    unlink(listener.endpoint.path.c_str());
  }
  for (int fd : wake_pipe_) {
    if (fd >= 0) close(fd);
  }
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(2);
  for (const Listener& listener : listeners_) {
    if (listener.server) listener.server->Shutdown(deadline);
    if (listener.refusal_server) listener.refusal_server->Shutdown(deadline);
  }
}

}  // namespace moesnap::daemon
