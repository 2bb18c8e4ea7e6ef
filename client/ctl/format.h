// What moesnapctl prints: tables for people, one JSON object for scripts, and the exit code a
// result maps to. Pure functions of the daemon's responses, testable without a daemon.
#ifndef MOESNAP_CLIENT_CTL_FORMAT_H_
#define MOESNAP_CLIENT_CTL_FORMAT_H_

#include <grpcpp/support/status.h>

#include <string>
#include <vector>

#include "proto/moesnap.pb.h"

namespace moesnap::ctl {

// Exit codes scripts can rely on.
enum ExitCode {
  kSuccess = 0,
  kProblemFound = 1,       // the command ran and found something wrong (verify: corruptions)
  kUsage = 2,              // bad command line
  kDaemonUnreachable = 3,  // nothing answered on the socket, or not in time
  kDaemonRefused = 4,      // the daemon answered with an error (its message is printed)
};

ExitCode ExitCodeFor(const grpc::Status& status);
// "cannot reach moesnapd at PATH ..." or the daemon's own message.
std::string DescribeError(const grpc::Status& status, const std::string& socket_path);
// The same with the code in front of the daemon's message ("NOT_FOUND: ..."), for people.
std::string DescribeErrorWithCode(const grpc::Status& status, const std::string& socket_path);
// The status code as a lower-case word for JSON errors ("not_found", "unavailable").
std::string ErrorCodeWord(const grpc::Status& status);

// Columns padded to their widest cell; the first row is the header.
std::string Table(const std::vector<std::vector<std::string>>& rows);

std::string FormatStatus(const v1::StatusResponse& status);
std::string FormatSteps(const v1::ListStepsResponse& steps);
std::string FormatInspect(const v1::InspectStepResponse& inspect);
std::string FormatWindows(const v1::ListWindowsResponse& windows);
std::string FormatVerify(const v1::VerifyResponse& verify);
std::string FormatDrop(int64_t step, const v1::DropStepResponse& drop);
std::string FormatClusterStatus(const v1::ClusterStatusResponse& cluster);
std::string FormatRebuild(uint32_t node, const v1::RebuildResponse& rebuild);

}  // namespace moesnap::ctl

#endif  // MOESNAP_CLIENT_CTL_FORMAT_H_
