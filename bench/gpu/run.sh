#!/usr/bin/env bash
# Run on the GPU machine, builds nothing: runs the programs bench/gpu/bundle.sh packed, through the
# bundled dynamic loader (so the machine's own C library version does not matter), with the
# machine's GPU driver. Writes gpu.json and gpu.md to OUT (default: the current directory).
#   bench/gpu/run.sh BUNDLE [OUT]
set -euo pipefail
bundle=$(cd "${1:?usage: run.sh BUNDLE [OUT]}" && pwd)
out=${2:-.}
mkdir -p "$out"
run() { "$bundle/lib/ld-linux-x86-64.so.2" --library-path "$bundle/lib" "$@"; }
# Tests start moesnapd as a child process: give them a wrapper that runs it through the loader too.
wrapped=$(mktemp -d)
trap 'rm -rf "$wrapped"' EXIT
printf '#!/bin/sh\nexec "%s" --library-path "%s" "%s" "$@"\n' \
  "$bundle/lib/ld-linux-x86-64.so.2" "$bundle/lib" "$bundle/bin/moesnapd" > "$wrapped/moesnapd"
chmod +x "$wrapped/moesnapd"
export MOESNAP_BIN_DIR=$wrapped
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "== gpu tests"
run "$bundle/bin/cuda_capture_test"
echo "== gpu benchmark"
# moesnap-bench finds nothing else on disk; the daemon runs inside it.
run "$bundle/bin/moesnap-bench" gpu --json "$out/gpu.json" --markdown "$out/gpu.md"
