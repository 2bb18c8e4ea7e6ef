#!/usr/bin/env bash
# Configures and builds moesnap into build/ (programs in build/bin/). Extra arguments go to the
# CMake configure step, e.g. -DMOESNAP_CUDA=OFF. Two jobs: the machines we build on have two cores
# and CI must stay inside its time.
#
# The compiler is clang unless CC and CXX name another when build/ is first configured (the tree
# keeps its compiler after that). Measured on this project's 2-core machine, clang compiles the
# project in 0.6 of the time gcc 12 takes, and the programs run as fast (bench/RESULTS.md); its
# thread-safety analysis also checks every lock annotation on every build. gcc builds it as well:
# CC=gcc CXX=g++ deploy/build.sh, into a fresh build/.
set -euo pipefail
cd "$(dirname "$0")/.."
export CC=${CC:-clang} CXX=${CXX:-clang++}
cmake -S . -B build -G Ninja "$@"
cmake --build build -j2
