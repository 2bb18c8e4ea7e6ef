#!/usr/bin/env bash
# Run on the GPU machine from the repository root (it runs the Python tests and
# bench/gpu_restart.py from there), builds nothing: runs the programs
# bench/gpu/bundle.sh packed, through the bundled dynamic loader (so the machine's own C library
# version does not matter), with the machine's GPU driver; then the Python package's GPU tests with
# the machine's python3 and its PyTorch, and bench/gpu_restart.py (a restarted GPU trainer against
# torch.load). Writes gpu.json, gpu.md and the logs to OUT (default: the current directory). Every part runs even if one before it failed; the exit status says whether
# all passed.
#   bench/gpu/run.sh BUNDLE [OUT]
set -uo pipefail
[ -d "${1:-}" ] || { echo "usage: bench/gpu/run.sh BUNDLE [OUT], from the repository root" >&2; exit 2; }
[ -f client/python/tests/test_cuda.py ] || { echo "run from the repository root" >&2; exit 2; }
bundle=$(cd "$1" && pwd)
out=${2:-.}
mkdir -p "$out"
out=$(cd "$out" && pwd)
run() { "$bundle/lib/ld-linux-x86-64.so.2" --library-path "$bundle/lib" "$@"; }
# Tests start moesnapd (and moesnapctl) as child processes: give them wrappers that run them
# through the loader too.
wrapped=$(mktemp -d)
trap 'rm -rf "$wrapped"' EXIT
for program in moesnapd moesnapctl; do
  printf '#!/bin/sh\nexec "%s" --library-path "%s" "%s" "$@"\n' \
    "$bundle/lib/ld-linux-x86-64.so.2" "$bundle/lib" "$bundle/bin/$program" > "$wrapped/$program"
  chmod +x "$wrapped/$program"
done
export MOESNAP_BIN_DIR=$wrapped
failed=0
part() {
  local name=$1
  shift
  echo "== $name"
  "$@" 2>&1 | tee "$out/$name.log"
  local status=${PIPESTATUS[0]}
  echo "== $name: exit $status"
  [ "$status" -eq 0 ] || failed=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
part cuda_capture_test run "$bundle/bin/cuda_capture_test"
part device_regions_test run "$bundle/bin/device_regions_test"
# moesnap-bench starts the daemon it measures through MOESNAP_BIN_DIR too.
part gpu_bench run "$bundle/bin/moesnap-bench" gpu --json "$out/gpu.json" --markdown "$out/gpu.md"
part python_gpu_tests env PYTHONPATH="$bundle/python" PYTHONUNBUFFERED=1 \
  python3 -m pytest -v -p no:cacheprovider client/python/tests/test_cuda.py
part gpu_restart env PYTHONPATH="$bundle/python" PYTHONUNBUFFERED=1 \
  python3 bench/gpu_restart.py --bin-dir "$wrapped" --capture-threads 6
exit $failed
