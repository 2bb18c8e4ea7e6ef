#!/usr/bin/env bash
# Installs every Debian package moesnap builds, tests and runs with. Idempotent: packages already
# present are skipped, so a second run costs one dpkg query. Needs root (or sudo) only when something
# is missing. The README lists what each package is for.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config          # toolchain
  clang lld libclang-rt-14-dev                          # the compiler and linker; libFuzzer, ASan, UBSan, TSan
  protobuf-compiler libprotobuf-dev                     # .proto -> C++, protobuf runtime
  libgrpc++-dev protobuf-compiler-grpc                  # gRPC control plane, grpc_cpp_plugin
  libisal-dev                                           # Reed-Solomon and CRC32C (Intel ISA-L)
  libabsl-dev                                           # Status/StatusOr, synchronization, containers
  libboost-dev libboost-system-dev                      # Asio data plane, Beast HTTP
  libtomlplusplus-dev                                   # TOML configuration
  libcli11-dev                                          # moesnapctl command line
  libgtest-dev libgmock-dev                             # unit and integration tests
  python3-pip python3-venv patchelf                    # the Python wheel: built, bundled, installed
  python3-torch python3-numpy python3-pytest            # PyTorch integration and its tests
  libtorch-dev                                          # c10 headers: the package's storage library
  systemd                                               # systemd-analyze verify of the unit file
  libsystemd-dev                                        # sd_notify: readiness and watchdog
  libspdlog-dev                                         # logging (text and JSON lines)
  prometheus                                            # the metrics test scrapes with the real server; promtool
  python3-yaml                                          # the Kubernetes example's test parses it
  etcd-server etcd-client                               # cluster control store; etcdctl for debugging
  openssl libssl-dev                                    # mutual TLS between daemons; deploy/make-certs.sh
  golang-etcd-server-dev                                # etcd's v3 API .proto files (C++ stubs)
  golang-github-gogo-protobuf-dev                       # gogoproto/gogo.proto, imported by them
  golang-github-grpc-ecosystem-grpc-gateway-dev         # google/api/annotations.proto, imported too
)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$package")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
