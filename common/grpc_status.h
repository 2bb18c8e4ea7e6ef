// Conversion between absl::Status (used everywhere in moesnap) and grpc::Status, at the edges where
// gRPC handlers return and client stubs receive. Codes map one to one; messages pass unchanged.
#ifndef MOESNAP_COMMON_GRPC_STATUS_H_
#define MOESNAP_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"

namespace moesnap {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace moesnap

#endif  // MOESNAP_COMMON_GRPC_STATUS_H_
