#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang; AddressSanitizer and UndefinedBehavior-
# Sanitizer, coverage-guided) in build-asan/, the tree deploy/sanitize.sh runs its AddressSanitizer
# tests in, and runs each for MOESNAP_FUZZ_SECONDS seconds (default 30) from its checked-in seed
# corpus. CI runs it after the test suite; a crash or a sanitizer report fails it and leaves the
# input that caused it in build-asan/tests/fuzz/.
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/sanitized-tree.sh
configure_asan_tree "-DMOESNAP_FUZZ_SECONDS=${MOESNAP_FUZZ_SECONDS:-30}" "$@"
cmake --build build-asan -j2 --target moesnap_fuzzers
ctest --test-dir build-asan -L '^fuzz$' -j2 --output-on-failure --no-tests=error
