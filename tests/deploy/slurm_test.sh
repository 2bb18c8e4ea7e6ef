#!/usr/bin/env bash
# The Slurm prolog and epilog against a real moesnapd, with Slurm's environment as slurmd sets it
# and a stand-in `scontrol` (Slurm itself is not installed here): the prolog starts the daemon with
# the node's index in the job and returns once it serves; the epilog stops it and removes its pool
# (or keeps it with MOESNAP_KEEP_POOL=1); a broken config fails the prolog with the daemon's error.
set -euo pipefail
source_dir=$1 bin_dir=$2
work=$(mktemp -d /tmp/moesnap-slurm-XXXXXX)
pool="moesnap-slurm-test-$$"
cleanup() {
  for pid_file in "$work"/state/*.pid; do
    [ -f "$pid_file" ] && kill -KILL "$(cat "$pid_file")" 2> /dev/null || true
  done
  rm -f "/dev/shm/$pool.data" "/dev/shm/$pool.journal"
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

mkdir -p "$work/bin" "$work/state"
cat > "$work/bin/scontrol" <<'FAKE'
#!/usr/bin/env bash
# scontrol show hostnames a,b,c: one host per line, as Slurm's scontrol prints them.
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: unsupported: $*" >&2; exit 1; }
tr ',' '\n' <<< "$3"
FAKE
chmod +x "$work/bin/scontrol"
cat > "$work/moesnapd.toml" <<CONFIG
[agent]
socket = "$work/agent.sock"
[admin]
socket = "$work/admin.sock"
[http]
address = "127.0.0.1:0"
[pool]
name = "$pool"
bytes = "16MiB"
journal_bytes = "1MiB"
lock = "off"
CONFIG

export PATH="$work/bin:$PATH" MOESNAP_CONFIG="$work/moesnapd.toml" MOESNAP_ADMIN_SOCKET="$work/admin.sock"
export MOESNAP_BIN_DIR="$bin_dir" MOESNAP_STATE_DIR="$work/state" MOESNAP_START_TIMEOUT=30
export MOESNAP_STOP_TIMEOUT=30 SLURM_JOB_ID=4242

# Node index from the job's node list (slurmd sets no SLURM_NODEID in the prolog's environment).
SLURMD_NODENAME=node-b SLURM_JOB_NODELIST=node-a,node-b,node-c bash "$source_dir/deploy/slurm/prolog.sh"
status=$("$bin_dir/moesnapctl" --socket "$work/admin.sock" status --json)
grep -q '"node_id":1,' <<< "$status" || fail "node id from the node list: $status"
pid=$(cat "$work/state/moesnapd.job4242.pid")
kill -0 "$pid" || fail "no daemon running"
[ -f "/dev/shm/$pool.data" ] || fail "no pool"
bash "$source_dir/deploy/slurm/epilog.sh"
! kill -0 "$pid" 2> /dev/null || [[ $(ps -o stat= -p "$pid") == Z* ]] || fail "daemon still running"
[ ! -e "/dev/shm/$pool.data" ] || fail "pool left behind"
[ ! -e "$work/state/moesnapd.job4242.pid" ] || fail "pid file left behind"
[ ! -e "$work/admin.sock" ] || fail "admin socket left behind"

# SLURM_NODEID where it is set; the pool kept on request.
SLURM_NODEID=2 bash "$source_dir/deploy/slurm/prolog.sh"
status=$("$bin_dir/moesnapctl" --socket "$work/admin.sock" status --json)
grep -q '"node_id":2,' <<< "$status" || fail "node id from SLURM_NODEID: $status"
MOESNAP_KEEP_POOL=1 bash "$source_dir/deploy/slurm/epilog.sh"
[ -f "/dev/shm/$pool.data" ] || fail "the pool should have been kept"
rm -f "/dev/shm/$pool.data" "/dev/shm/$pool.journal"

# A node outside the job's list, and a broken config: the prolog fails and says why.
if output=$(SLURMD_NODENAME=node-z SLURM_JOB_NODELIST=node-a,node-b bash "$source_dir/deploy/slurm/prolog.sh" 2>&1); then
  fail "a node outside the job started a daemon"
fi
grep -q "node-z is not in the job's node list" <<< "$output" || fail "unclear refusal: $output"
sed -i 's/^lock = "off"/lock = "sometimes"/' "$work/moesnapd.toml"
if output=$(SLURM_NODEID=0 bash "$source_dir/deploy/slurm/prolog.sh" 2>&1); then
  fail "a broken config started a daemon"
fi
grep -q "pool.lock" <<< "$output" || fail "the config error was not shown: $output"
[ ! -e "/dev/shm/$pool.data" ] || fail "a refused start created the pool"
echo "slurm prolog and epilog: 1 passed, 0 failed"
