#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (AddressSanitizer and UndefinedBehavior-
# Sanitizer, coverage-guided) into build-fuzz/ and runs each for MOESNAP_FUZZ_SECONDS seconds
# (default 30) from its checked-in seed corpus. CI runs it after the test suite; a crash or a
# sanitizer report fails it and leaves the input that caused it in build-fuzz/.
set -euo pipefail
cd "$(dirname "$0")/.."
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DMOESNAP_FUZZ=ON -DMOESNAP_CUDA=OFF \
  "-DMOESNAP_FUZZ_SECONDS=${MOESNAP_FUZZ_SECONDS:-30}" "$@"
cmake --build build-fuzz -j2 --target moesnap_fuzzers
ctest --test-dir build-fuzz -L fuzz -j2 --output-on-failure --no-tests=error
