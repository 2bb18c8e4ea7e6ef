#!/usr/bin/env bash
# The main job: installs the dependencies, builds moesnap, and demonstrates what it survives, with a
# report. Part 1 runs a real moesnapd and a trainer rank holding 256 MiB of state that changes every
# step; it SIGKILLs the trainer while a snapshot is being copied, then SIGKILLs the daemon, and each
# time a fresh trainer restores and checks every byte. Part 2 shows the erasure layer: stripes that
# lose m units each are rebuilt bit-identical. Extra arguments go to moesnap-erasure-demo.
# Leaves nothing running and removes everything it created.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh

bin=build/bin
work=$(mktemp -d /tmp/moesnap-demo.XXXXXX)
pool="moesnap-demo-$$"
daemon_pid=""
cleanup() {
  [ -n "$daemon_pid" ] && kill -9 "$daemon_pid" 2>/dev/null || true
  rm -f "/dev/shm/$pool.data" "/dev/shm/$pool.journal"
  rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/moesnapd.toml" <<CONFIG
[agent]
socket = "$work/agent.sock"
[admin]
socket = "$work/admin.sock"
[pool]
name = "$pool"
bytes = "768MiB"
lock = "off"
CONFIG

start_daemon() {
  "$bin/moesnapd" --config "$work/moesnapd.toml" 2>>"$work/moesnapd.log" &
  daemon_pid=$!
  for _ in $(seq 200); do [ -S "$work/agent.sock" ] && return 0; sleep 0.05; done
  echo "moesnapd did not start; its log:" >&2; cat "$work/moesnapd.log" >&2; exit 1
}
trainer() { "$bin/moesnap-test-trainer" --socket "$work/agent.sock" --regions 64 --region-bytes 4194304 "$@"; }
# Runs a training trainer until it prints the line matching $1, then SIGKILLs it; prints that line.
train_until() {
  local pattern=$1 line
  coproc TRAINER { trainer --mode train --steps 1000000; }
  local pid=$TRAINER_PID
  while IFS= read -r line <&"${TRAINER[0]}"; do
    if [[ $line =~ $pattern ]]; then kill -9 "$pid"; wait "$pid" 2>/dev/null || true; echo "$line"; return; fi
  done
  echo "the trainer stopped early" >&2; exit 1
}
millis() { date +%s%3N; }

echo "== part 1: one node, real moesnapd, a trainer rank with 256 MiB of state (64 regions)"
start_daemon
last=$(train_until '^snapshot 7$')
echo "trainer SIGKILLed right after '$last' (step 7 still being copied)"
report=$(trainer --mode verify)
echo "fresh trainer: ${report//$'\n'/, }; every byte equal"

last=$(train_until '^captured 12$')
kill -9 "$daemon_pid"; wait "$daemon_pid" 2>/dev/null || true; daemon_pid=""
echo "trainer and moesnapd SIGKILLed after '$last'"
t0=$(millis); start_daemon; t1=$(millis)
report=$(trainer --mode verify)
echo "moesnapd restarted in $((t1 - t0)) ms and re-attached its pool"
echo "fresh trainer: ${report//$'\n'/, }; every byte equal"
kill "$daemon_pid"; wait "$daemon_pid" 2>/dev/null || true; daemon_pid=""

echo
echo "== part 2: erasure coding, m units of every stripe lost and rebuilt"
"$bin/moesnap-erasure-demo" "$@"
echo
echo "RESULT: every failure recovered bit-identical"
