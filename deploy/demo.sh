#!/usr/bin/env bash
# The main job: installs the dependencies, builds moesnap, and demonstrates what it survives, with a
# report. Part 1 runs a real moesnapd and a trainer rank holding 256 MiB of state that changes every
# step; it SIGKILLs the trainer while a snapshot is being copied, then SIGKILLs the daemon, and each
# time a fresh trainer restores and checks every byte. Part 2 kills a PyTorch MoE trainer the same
# way and compares its losses and final state with an uninterrupted run. Part 3 shows the erasure
# layer: stripes that lose m units each are rebuilt bit-identical. Extra arguments go to
# moesnap-erasure-demo.
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
  # exec: the coprocess is the trainer itself, so the SIGKILL below reaches it, not a subshell.
  coproc TRAINER { exec "$bin/moesnap-test-trainer" --socket "$work/agent.sock" --regions 64 \
                          --region-bytes 4194304 --mode train --steps 1000000; }
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

echo
echo "== part 2: a PyTorch MoE trainer (4 layers x 8 experts, top-2, Adam), SIGKILLed mid-capture"
export PYTHONPATH=$PWD/build/python
moe=client/python/examples/moe_train.py
/usr/bin/python3 "$moe" --steps 20 --out "$work/reference.pt" > "$work/reference.log"
coproc MOE { exec /usr/bin/python3 "$moe" --socket "$work/agent.sock" --rank 1 --steps 20; }
moe_pid=$MOE_PID
killed=no
while IFS= read -r line <&"${MOE[0]}"; do
  echo "$line" >> "$work/run.log"
  if [ "$line" = "snapshot 9" ]; then kill -9 "$moe_pid"; wait "$moe_pid" 2>/dev/null || true; killed=yes; break; fi
done
[ "$killed" = yes ] || { echo "the MoE trainer stopped before step 9" >&2; exit 1; }
echo "trainer SIGKILLed right after 'snapshot 9'"
/usr/bin/python3 "$moe" --socket "$work/agent.sock" --rank 1 --steps 20 --out "$work/restored.pt" >> "$work/run.log"
grep '^restored' "$work/run.log" | sed 's/^/fresh trainer: /'
/usr/bin/python3 - "$work" <<'COMPARE'
import re, sys, torch
work = sys.argv[1]
def losses(path):
    found = {}
    for line in open(path):
        m = re.fullmatch(r"step (\d+) loss (\S+)\n", line)
        if m: found.setdefault(int(m.group(1)), set()).add(m.group(2))
    return found
reference, run = losses(f"{work}/reference.log"), losses(f"{work}/run.log")
same_losses = all(run[step] == {value} for step, (value,) in ((s, tuple(v)) for s, v in reference.items()))
a, b = torch.load(f"{work}/reference.pt"), torch.load(f"{work}/restored.pt")
same_model = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
same_adam = all(torch.equal(t, b["optimizer"]["state"][i][k])
                for i, s in a["optimizer"]["state"].items() for k, t in s.items())
print(f"losses of all 20 steps (re-run ones included) bit-identical to an uninterrupted run: {same_losses}")
print(f"final parameters bit-identical: {same_model}; Adam moments and step counters: {same_adam}")
sys.exit(0 if same_losses and same_model and same_adam else 1)
COMPARE
kill "$daemon_pid"; wait "$daemon_pid" 2>/dev/null || true; daemon_pid=""

echo
echo "== part 3: erasure coding, m units of every stripe lost and rebuilt"
"$bin/moesnap-erasure-demo" "$@"
echo
echo "RESULT: every failure recovered bit-identical"
