#!/usr/bin/env bash
# Configures and builds moesnap into build/ (programs in build/bin/). Extra arguments go to the
# CMake configure step, e.g. -DMOESNAP_SANITIZE=address,undefined. Two jobs: the machines we build
# on have two cores and CI must stay inside its time.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja "$@"
cmake --build build -j2
