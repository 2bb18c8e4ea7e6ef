# Sourced by deploy/sanitize.sh and deploy/fuzz.sh: how a sanitized build tree is configured.

# configure_sanitized_tree TREE SANITIZERS [CMAKE_ARGS...]: a tree of its own, built by clang at -O0
# with line tables (reports name file and line). Measured on this project's 2-core machine, clang
# -O0 compiles a sanitized daemon source in a third of the time gcc -O1 takes (gcc's UBSan
# instrumentation is the cost), and the tests run fast enough unoptimized. No CUDA: no device here.
configure_sanitized_tree() {
  local tree=$1 sanitizers=$2
  shift 2
  CC=clang CXX=clang++ cmake -S . -B "$tree" -G Ninja -DMOESNAP_SANITIZE="$sanitizers" \
    -DMOESNAP_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-gline-tables-only \
    -DCMAKE_C_FLAGS_DEBUG=-gline-tables-only "$@"
}

# configure_asan_tree [CMAKE_ARGS...]: build-asan/, AddressSanitizer and UndefinedBehaviorSanitizer.
# It holds the sanitizer tests and the fuzzers alike (MOESNAP_FUZZ=ON), so the libraries both link
# are built once.
configure_asan_tree() {
  configure_sanitized_tree build-asan address,undefined -DMOESNAP_FUZZ=ON "$@"
}
