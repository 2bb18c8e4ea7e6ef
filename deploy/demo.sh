#!/usr/bin/env bash
# The main job: installs the dependencies, builds moesnap, and demonstrates what it survives, with a
# report. Part 1 runs a real moesnapd and a trainer rank holding 256 MiB of state that changes every
# step; it SIGKILLs the trainer while a snapshot is being copied, then SIGKILLs the daemon, and each
# time a fresh trainer restores and checks every byte. Part 2 kills a PyTorch MoE trainer the same
# way and compares its losses and final state with an uninterrupted run. Part 3 runs a cluster of six
# daemons (k = 4, m = 2) on a local etcd (or the one $MOESNAP_DEMO_ETCD names, "host:port,..."),
# with a trainer per node, loses two nodes with their memory, rebuilds them from parity and checks
# every byte on every node, then loses three (more than m) and shows the error.
# Part 4 shows the erasure layer alone. Part 5 runs a 3-stage pipeline on a 3-node cluster, loses a
# stage's trainer and then a stage's node, and recovers each stage alone from its sparse window and
# its neighbours' upstream logs. Extra arguments go to moesnap-erasure-demo.
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
[http]
address = "127.0.0.1:0"
[pool]
name = "$pool"
bytes = "768MiB"
lock = "off"
CONFIG

# True once daemon process $2 answers operators on admin socket $1 (then every socket is served).
serving() { "$bin/moesnapctl" --socket "$1" status --json 2>/dev/null | grep -q "\"pid\":$2[,}]"; }
start_daemon() {
  "$bin/moesnapd" --config "$work/moesnapd.toml" 2>>"$work/moesnapd.log" &
  daemon_pid=$!
  for _ in $(seq 400); do serving "$work/admin.sock" "$daemon_pid" && return 0; sleep 0.05; done
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
grep -E '^(restored|took over)' "$work/run.log" | sed 's/^/fresh trainer: /'
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
echo "== part 3: a cluster of 6 moesnapd on loopback (k=4 data + m=2 parity), a trainer per node"
cluster_pids=()
etcd_pid=""
cluster_cleanup() {
  for pid in "${cluster_pids[@]}" "$etcd_pid"; do
    [ -n "$pid" ] && { kill -9 "$pid"; wait "$pid"; } 2>/dev/null || true
  done
  rm -f /dev/shm/"$pool"-node*.data /dev/shm/"$pool"-node*.journal
  cleanup
}
trap cluster_cleanup EXIT
# The job's daemons authenticate each other (and etcd) with certificates of the job's CA, made
# here as an operator would make them (deploy/make-certs.sh).
tls="$work/tls"
"$(dirname "$0")/make-certs.sh" --etcd-ip 127.0.0.1 "$tls" "demo-$$" 6 >/dev/null
# The job's control state (who is where, who coordinates, what each step's outcome is) lives in
# etcd: an existing one (reached in plaintext, so the demo's peers run in plaintext on loopback
# too: tls.insecure), or one started here with mutual TLS.
if [ -n "${MOESNAP_DEMO_ETCD:-}" ]; then
  etcd_endpoints=$MOESNAP_DEMO_ETCD
  tls_section=$'[tls]\ninsecure = true'
  echo "etcd: $etcd_endpoints (from MOESNAP_DEMO_ETCD, plaintext; peers in plaintext on loopback)"
else
  read -r etcd_client etcd_peer <<< "$(/usr/bin/python3 -c '
import socket
sockets = [socket.socket() for _ in range(2)]
for s in sockets: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in sockets))')"
  etcd_endpoints="127.0.0.1:$etcd_client"
  etcd --name demo --data-dir "$work/etcd" --listen-client-urls "https://$etcd_endpoints" \
    --advertise-client-urls "https://$etcd_endpoints" --listen-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-cluster "demo=http://127.0.0.1:$etcd_peer" --cert-file "$tls/etcd.pem" \
    --key-file "$tls/etcd.key" --client-cert-auth --trusted-ca-file "$tls/ca.pem" \
    --log-level warn 2>"$work/etcd.log" &
  etcd_pid=$!
  for _ in $(seq 200); do
    /usr/bin/python3 -c "import ssl, urllib.request, sys
context = ssl.create_default_context(cafile='$tls/ca.pem')
context.load_cert_chain('$tls/node-0.pem', '$tls/node-0.key')
sys.exit(b'\"true\"' not in urllib.request.urlopen('https://$etcd_endpoints/health', timeout=1,
                                                   context=context).read())" 2>/dev/null && break
    sleep 0.05
  done
  tls_section="[tls]
ca_file = \"$tls/ca.pem\"
cert_file = \"$tls/node-{node}.pem\"
key_file = \"$tls/node-{node}.key\""
  echo "etcd: started on $etcd_endpoints for the demo, mutual TLS (point MOESNAP_DEMO_ETCD at an existing one)"
fi
etcd_list="\"${etcd_endpoints//,/\", \"}\""
# One [cluster] section for every node; each daemon gets its id and address on the command line,
# as a Slurm or Kubernetes job would from its environment.
for id in 0 1 2 3 4 5; do
  cat > "$work/node$id.toml" <<CONFIG
[agent]
socket = "$work/node$id.agent.sock"
[admin]
socket = "$work/node$id.admin.sock"
[http]
address = "127.0.0.1:0"
[pool]
name = "$pool-node$id"
bytes = "128MiB"
lock = "off"
[cluster]
job = "demo-$$"
node_count = 6
data_units = 4
parity_units = 2
stripe_unit_bytes = "1MiB"
lease_ttl_ms = 2000
etcd_endpoints = [$etcd_list]
control_port = 0
data_port = 0
$tls_section
CONFIG
done
start_node() {
  rm -f "$work/node$1.agent.sock"
  "$bin/moesnapd" --config "$work/node$1.toml" --node-id "$1" --advertise-host 127.0.0.1 \
    2>>"$work/node$1.log" &
  cluster_pids[$1]=$!
  for _ in $(seq 400); do serving "$work/node$1.admin.sock" "${cluster_pids[$1]}" && return 0; sleep 0.05; done
  echo "node $1 did not start; its log:" >&2; cat "$work/node$1.log" >&2; exit 1
}
# Node i's trainer holds 8 + 2i regions of 1 MiB: unequal shares, as real ranks have.
node_trainer() {
  "$bin/moesnap-test-trainer" --socket "$work/node$1.agent.sock" --rank "$1" \
    --regions $((8 + 2 * $1)) --region-bytes 1048576 "${@:2}"
}
ctl() { "$bin/moesnapctl" --socket "$work/node$1.admin.sock" "${@:2}"; }
lose_node() {  # SIGKILL the daemon and throw its memory away: the node is gone
  { kill -9 "${cluster_pids[$1]}"; wait "${cluster_pids[$1]}" || true; } 2>/dev/null
  cluster_pids[$1]=""
  rm -f "/dev/shm/$pool-node$1.data" "/dev/shm/$pool-node$1.journal"
}
wait_settled() {
  for _ in $(seq 100); do
    if [ "$(ctl 0 cluster status | grep -c ' live')" = 6 ] && ! ctl 0 cluster status | grep -q rebuilding; then
      return 0
    fi
    sleep 0.1
  done
  echo "the cluster did not settle" >&2; ctl 0 cluster status >&2; exit 1
}
# Waits until each node given after the step reports that step committed in its own memory.
wait_rebuilt() {
  local step=$1 id
  shift
  for id in "$@"; do
    for _ in $(seq 200); do
      ctl "$id" cluster status 2>/dev/null | head -1 | grep -q "latest committed step $step\$" && continue 2
      sleep 0.1
    done
    echo "node $id did not rebuild step $step; its log:" >&2; cat "$work/node$id.log" >&2; exit 1
  done
}
for id in 0 1 2 3 4 5; do start_node $id; done
wait_settled
trainer_pids=()
for id in 0 1 2 3 4 5; do node_trainer $id --mode train --steps 8 > "$work/train$id.log" & trainer_pids+=($!); done
for pid in "${trainer_pids[@]}"; do wait "$pid"; done
# Every node applies the decision of step 8 from etcd: wait until all six report it.
for _ in $(seq 50); do [ "$(ctl 0 cluster status | grep -c ' live.* 8 ')" = 6 ] && break; sleep 0.1; done
echo "6 trainers ran 8 steps; every step committed on all nodes with parity spread over the group:"
ctl 0 cluster status
echo
lose_node 1; lose_node 4
echo "nodes 1 and 4 lost (moesnapd SIGKILLed, memory discarded); replacements start empty"
t0=$(millis); start_node 1; start_node 4; wait_rebuilt 8 1 4; t1=$(millis)
grep -h 'rebuilt step' "$work/node1.log" "$work/node4.log" | sed 's/^[^ ]* [a-z]* /  /' || true
echo "replacements rebuilt from the 4 survivors in $((t1 - t0)) ms (start-up included)"
for id in 0 1 2 3 4 5; do
  report=$(node_trainer $id --mode verify)
  echo "node $id: fresh trainer ${report//$'\n'/, }; every byte equal"
done
echo
lose_node 0; lose_node 2; lose_node 3
start_node 2
echo "nodes 0, 2 and 3 lost: more than m = 2 of the group, so node 2's data is gone, and it says so:"
if report=$(node_trainer 2 --mode verify); then echo "node 2 restored what it cannot have" >&2; exit 1; fi
echo "  ${report#error restore: }"
for id in 1 4 5; do
  report=$(node_trainer $id --mode verify)
  echo "node $id (a survivor): ${report//$'\n'/, }; every byte equal"
done

echo
echo "== part 4: the erasure layer alone, m units of every stripe lost and rebuilt"
"$bin/moesnap-erasure-demo" "$@"

echo
echo "== part 5: a 3-stage MoE pipeline (gloo) on a 3-node cluster (k=2, m=1), sparse snapshots and"
echo "   upstream logs on; a stage's trainer (after a step, then mid-backward), then a stage's whole node, SIGKILLed at a random step"
# The pipeline recovery tests are this part: each prints its report line once its checks passed.
if ! MOESNAP_BIN_DIR=$PWD/$bin /usr/bin/python3 -m pytest -q -s -p no:cacheprovider \
       client/python/tests/test_pipeline.py -k "killed or mid_backward or lost_node" > "$work/pipeline.log" 2>&1; then
  echo "the pipeline recovery failed; the end of its log:" >&2; tail -n 80 "$work/pipeline.log" >&2
  exit 1
fi
grep -o 'pipeline: .*' "$work/pipeline.log" | sed 's/^pipeline: /  /'
echo
echo "RESULT: every failure within the code's limits recovered bit-identical; beyond them, a clear error"
