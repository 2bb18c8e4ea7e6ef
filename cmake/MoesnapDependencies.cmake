# Finds every dependency once, as imported targets, so that folder CMakeLists only name them.
# All come from Debian packages (deploy/install-deps.sh); nothing is downloaded at build time.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(absl REQUIRED CONFIG)
find_package(Protobuf REQUIRED)
find_package(GTest REQUIRED CONFIG)
find_package(CLI11 REQUIRED CONFIG)
find_package(tomlplusplus REQUIRED CONFIG)
find_package(Boost 1.74 REQUIRED COMPONENTS system)
# Mutual TLS between daemons: the data plane's TLS sessions (OpenSSL) and certificate checks (libssl-dev).
find_package(OpenSSL 3 REQUIRED)
find_package(spdlog REQUIRED CONFIG)

# Debian's gRPC is used through pkg-config: its CMake package config is incomplete on this release.
pkg_check_modules(GRPCPP REQUIRED IMPORTED_TARGET grpc++)
find_program(MOESNAP_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)

# sd_notify for readiness and the watchdog (libsystemd-dev).
pkg_check_modules(SYSTEMD REQUIRED IMPORTED_TARGET libsystemd)

# Intel ISA-L ships neither pkg-config nor CMake files.
find_path(ISAL_INCLUDE_DIR isa-l/erasure_code.h REQUIRED)
find_library(ISAL_LIBRARY isal REQUIRED)
add_library(moesnap::isal UNKNOWN IMPORTED)
set_target_properties(moesnap::isal PROPERTIES
  IMPORTED_LOCATION ${ISAL_LIBRARY}
  INTERFACE_INCLUDE_DIRECTORIES ${ISAL_INCLUDE_DIR})

# CUDA: only the runtime API is used (IPC, events, async copies, host registration), so the CUDA
# language is never enabled; the toolkit is a library dependency.
string(TOUPPER "${MOESNAP_CUDA}" MOESNAP_CUDA)
if(NOT MOESNAP_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "MOESNAP_CUDA must be AUTO, ON or OFF, not '${MOESNAP_CUDA}'")
endif()
set(MOESNAP_HAVE_CUDA OFF)
if(NOT MOESNAP_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(MOESNAP_HAVE_CUDA ON)
    message(STATUS "moesnap: CUDA ${CUDAToolkit_VERSION} found, the CUDA copy backend is built")
  elseif(MOESNAP_CUDA STREQUAL "ON")
    message(FATAL_ERROR "MOESNAP_CUDA=ON but no CUDA toolkit was found "
                        "(set CUDAToolkit_ROOT, or use MOESNAP_CUDA=AUTO|OFF)")
  else()
    message(STATUS "moesnap: no CUDA toolkit found, building the host copy backend only")
  endif()
endif()

# etcd's v3 API .proto files, from Debian's Go source packages (no C++ etcd client is packaged). They
# import each other as "etcd/...", gogoproto/gogo.proto (Go code generation options only) and
# google/api/annotations.proto (HTTP gateway bindings): three import roots.
find_path(MOESNAP_ETCD_PROTO_ROOT etcd/etcdserver/etcdserverpb/rpc.proto
  PATHS /usr/share/gocode/src/go.etcd.io NO_DEFAULT_PATH REQUIRED)
find_path(MOESNAP_GOGO_PROTO_ROOT gogoproto/gogo.proto
  PATHS /usr/share/gocode/src/github.com/gogo/protobuf NO_DEFAULT_PATH REQUIRED)
find_path(MOESNAP_GOOGLEAPIS_PROTO_ROOT google/api/annotations.proto
  PATHS /usr/share/gocode/src/github.com/grpc-ecosystem/grpc-gateway/third_party/googleapis
  NO_DEFAULT_PATH REQUIRED)
# Tests start real etcd members, and make certificates for the TLS tests with openssl.
find_program(MOESNAP_ETCD etcd REQUIRED)
find_program(MOESNAP_OPENSSL openssl REQUIRED)
