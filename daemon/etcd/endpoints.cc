// Endpoints: channels, failover and the retry rule of the etcd client.
#include "daemon/etcd/endpoints.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/metrics.h"

namespace moesnap::etcd::internal {
namespace {

// etcd connectivity as /metrics shows it, registered when the program starts.
metrics::Gauge& etcd_reachable = metrics::Registry::Default().AddGauge(
    "moesnap_etcd_reachable", "1 when the last etcd request got an answer, 0 when none did");
metrics::Counter& etcd_answered = metrics::Registry::Default().AddCounter(
    "moesnap_etcd_attempts_total",
    "etcd request attempts: answered (a definite reply) or not (no connection, no leader, unknown)",
    {{"outcome", "answered"}});
metrics::Counter& etcd_unanswered = metrics::Registry::Default().AddCounter(
    "moesnap_etcd_attempts_total",
    "etcd request attempts: answered (a definite reply) or not (no connection, no leader, unknown)",
    {{"outcome", "unanswered"}});
metrics::Counter& etcd_failovers = metrics::Registry::Default().AddCounter(
    "moesnap_etcd_failovers_total",
    "Times an etcd answer came from another endpoint than the last answer did");

// Counts an attempt: `answered` when a member gave a definite answer (success or a refusal).
void CountAttempt(bool answered) {
  (answered ? etcd_answered : etcd_unanswered).Add();
  etcd_reachable.Set(answered ? 1 : 0);
}

absl::StatusOr<std::string> ReadPemFile(const char* option, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read etcd tls.", option, " '", path, "': ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << file.rdbuf();
  if (contents.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd tls.", option, " '", path, "' holds no PEM block (no '-----BEGIN ')"));
  }
  return contents.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const TlsOptions& tls) {
  if (tls.ca_file.empty() && tls.cert_file.empty() && tls.key_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  if (tls.ca_file.empty()) {
    return absl::InvalidArgumentError(
        "etcd tls.cert_file/key_file given without tls.ca_file: the members' CA is needed to check "
        "them");
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd mutual TLS needs both tls.cert_file and tls.key_file; got cert_file '",
                     tls.cert_file, "' and key_file '", tls.key_file, "'"));
  }
  grpc::SslCredentialsOptions ssl;
  absl::StatusOr<std::string> ca = ReadPemFile("ca_file", tls.ca_file);
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *std::move(ca);
  if (!tls.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPemFile("cert_file", tls.cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile("key_file", tls.key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

absl::Status CheckEndpoint(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(endpoint.substr(colon + 1), &port) || port == 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "etcd endpoint '", endpoint, "' is not host:port (e.g. 127.0.0.1:2379, etcd-0.etcd:2379)"));
  }
  return absl::OkStatus();
}

grpc::ChannelArguments ChannelArguments() {
  grpc::ChannelArguments arguments;
  // A member that comes back (restarted, partition healed) is reconnected within a second, not
  // after gRPC's default backoff of up to two minutes.
  arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Pings on open streams notice a member that stopped answering (SIGSTOP, a cut link); etcd
  // refuses pings more often than every 5 s (--grpc-keepalive-min-time).
  arguments.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  arguments.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  // Each client keeps its own connections, so one client's failover never depends on another's.
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // A prefix read of a large job's membership may exceed gRPC's default 4 MiB.
  arguments.SetMaxReceiveMessageSize(64 << 20);
  return arguments;
}

std::chrono::system_clock::time_point ToChrono(absl::Time time) { return absl::ToChronoTime(time); }

}  // namespace

Failure ClassifyFailure(const grpc::Status& status) {
  const std::string& message = status.error_message();
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      // Refused by the member before the request reached raft (etcd's v3rpc interceptors), or never
      // sent because no connection could be made.
      if (message == "etcdserver: no leader" || message == "etcdserver: not capable" ||
          message == "etcdserver: rpc not supported for learner" ||
          message.find("failed to connect to all addresses") != std::string::npos) {
        return Failure::kNotApplied;
      }
      return Failure::kOutcomeUnknown;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return message == "etcdserver: too many requests" ? Failure::kNotApplied : Failure::kDefinite;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::DATA_LOSS:
      return Failure::kOutcomeUnknown;
    default:
      return Failure::kDefinite;
  }
}

std::string Describe(const grpc::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                      ": ", status.error_message());
}

absl::StatusOr<std::shared_ptr<Endpoints>> Endpoints::Create(const Options& options) {
  if (options.endpoints.empty()) {
    return absl::InvalidArgumentError("etcd client needs at least one endpoint, got none");
  }
  for (const auto& [name, value] : {std::pair{"call_timeout", options.call_timeout},
                                    std::pair{"attempt_timeout", options.attempt_timeout},
                                    std::pair{"dial_timeout", options.dial_timeout}}) {
    if (value <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd ", name, " must be positive, got ", absl::FormatDuration(value)));
    }
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = Credentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  std::vector<std::unique_ptr<Endpoint>> endpoints;
  for (const std::string& address : options.endpoints) {
    if (absl::Status status = CheckEndpoint(address); !status.ok()) return status;
    auto endpoint = std::make_unique<Endpoint>();
    endpoint->address = address;
    endpoint->channel = grpc::CreateCustomChannel(address, *credentials, ChannelArguments());
    endpoint->kv = etcdserverpb::KV::NewStub(endpoint->channel);
    endpoint->lease = etcdserverpb::Lease::NewStub(endpoint->channel);
    endpoint->watch = etcdserverpb::Watch::NewStub(endpoint->channel);
    endpoint->maintenance = etcdserverpb::Maintenance::NewStub(endpoint->channel);
    endpoints.push_back(std::move(endpoint));
  }
  return std::shared_ptr<Endpoints>(new Endpoints(options, std::move(endpoints)));
}

Endpoints::Endpoints(Options options, std::vector<std::unique_ptr<Endpoint>> endpoints)
    : options_(std::move(options)), endpoints_(std::move(endpoints)) {}

void Endpoints::MoveAwayFrom(size_t index) {
  size_t expected = index;
  preferred_.compare_exchange_strong(expected, (index + 1) % endpoints_.size());
}

void Endpoints::Answered(size_t index) {
  // An answer to a call begun before the client moved on is not a move back.
  if (index != preferred_.load()) return;
  if (last_answered_.exchange(index) != index) etcd_failovers.Add();
}

bool Endpoints::Connect(size_t index, absl::Time deadline) const {
  grpc::Channel& channel = *endpoints_[index]->channel;
  const auto dial_deadline = ToChrono(std::min(deadline, absl::Now() + options_.dial_timeout));
  grpc_connectivity_state state = channel.GetState(/*try_to_connect=*/true);
  // While gRPC reports the channel in TRANSIENT_FAILURE (a connect refused, a failed TLS handshake
  // or name resolution), the member is left for the next endpoint at once rather than waited for:
  // gRPC reconnects by itself after its backoff (about a second for a connect), and a later call
  // finds it back. Only a connection still being made is waited for, up to the dial timeout.
  while (state != GRPC_CHANNEL_READY) {
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN) return false;
    if (!channel.WaitForStateChange(state, dial_deadline)) return false;
    state = channel.GetState(/*try_to_connect=*/true);
  }
  return true;
}

void Endpoints::Prepare(grpc::ClientContext& context, absl::Time deadline) const {
  context.set_deadline(ToChrono(std::min(deadline, absl::Now() + options_.attempt_timeout)));
  context.AddMetadata("hasleader", "true");
}

absl::Status Endpoints::Call(const std::string& what, Retry retry, absl::Time deadline,
                             Attempt attempt) {
  // The last failure seen on each endpoint, for the message if none answers.
  std::vector<std::string> failures(endpoints_.size());
  const absl::Time start = absl::Now();
  size_t index = preferred();
  size_t tried_this_round = 0;
  while (absl::Now() < deadline) {
    const Endpoint& endpoint = *endpoints_[index];
    if (!Connect(index, deadline)) {
      CountAttempt(false);
      failures[index] = "no connection";
      MoveAwayFrom(index);
    } else {
      grpc::ClientContext context;
      Prepare(context, deadline);
      const grpc::Status status = attempt(endpoint, context);
      const Failure failure = status.ok() ? Failure::kDefinite : ClassifyFailure(status);
      CountAttempt(failure == Failure::kDefinite);
      if (failure == Failure::kDefinite) Answered(index);
      if (status.ok()) return absl::OkStatus();
      if (failure == Failure::kDefinite) {
        return absl::Status(
            static_cast<absl::StatusCode>(status.error_code()),
            absl::StrCat("etcd ", what, " at ", endpoint.address, ": ", status.error_message()));
      }
      MoveAwayFrom(index);
      if (failure == Failure::kOutcomeUnknown && retry == Retry::kOnlyIfNotApplied) {
        return absl::UnavailableError(absl::StrCat(
            "etcd ", what, " at ", endpoint.address, ": outcome unknown (", Describe(status),
            "); the write may or may not have been applied, read the key to know"));
      }
      failures[index] = Describe(status);
    }
    index = (index + 1) % endpoints_.size();
    if (++tried_this_round == endpoints_.size()) {
      // Every endpoint failed once: give the members a moment (a leader election takes about one
      // election timeout) instead of spinning, without passing the deadline.
      tried_this_round = 0;
      const absl::Duration pause = std::min(absl::Milliseconds(50), deadline - absl::Now());
      if (pause > absl::ZeroDuration()) absl::SleepFor(pause);
    }
  }
  std::vector<std::string> tried;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    tried.push_back(absl::StrCat(endpoints_[i]->address, " (",
                                 failures[i].empty() ? "not reached" : failures[i], ")"));
  }
  const absl::Duration allowed = absl::Trunc(deadline - start, absl::Milliseconds(1));
  return absl::DeadlineExceededError(absl::StrCat("etcd ", what, ": no endpoint answered within ",
                                                  absl::FormatDuration(allowed), ": ",
                                                  absl::StrJoin(tried, ", ")));
}

}  // namespace moesnap::etcd::internal
