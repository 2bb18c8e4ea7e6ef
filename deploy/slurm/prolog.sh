#!/usr/bin/env bash
# Slurm Prolog (slurm.conf: Prolog=/etc/moesnap/slurm/prolog.sh, PrologFlags=Alloc): starts this
# job's moesnapd on each of its nodes before any task runs, and fails the prolog (Slurm then drains
# the node and requeues the job) unless the daemon answers on its admin socket.
#
# The node id is the node's index in the job: $SLURM_NODEID where Slurm sets it, else the position
# of $SLURMD_NODENAME in `scontrol show hostnames $SLURM_JOB_NODELIST`. The daemon runs as the job's
# user (so the job's trainers may connect) with the site config and --node-id.
#
# Environment (all optional): MOESNAP_CONFIG (default /etc/moesnap/moesnapd.toml), MOESNAP_ADMIN_SOCKET
# (the config's admin socket, default /run/moesnap/admin.sock), MOESNAP_BIN_DIR (default
# /usr/local/bin), MOESNAP_STATE_DIR (pid and log files, default /run/moesnap),
# MOESNAP_START_TIMEOUT (seconds, default 60).
set -euo pipefail

config=${MOESNAP_CONFIG:-/etc/moesnap/moesnapd.toml}
admin_socket=${MOESNAP_ADMIN_SOCKET:-/run/moesnap/admin.sock}
bin_dir=${MOESNAP_BIN_DIR:-/usr/local/bin}
state_dir=${MOESNAP_STATE_DIR:-/run/moesnap}
timeout=${MOESNAP_START_TIMEOUT:-60}
job=${SLURM_JOB_ID:?the Slurm prolog runs with SLURM_JOB_ID set}

node_id() {
  if [ -n "${SLURM_NODEID:-}" ]; then
    echo "$SLURM_NODEID"
    return
  fi
  local index=0 host
  for host in $(scontrol show hostnames "${SLURM_JOB_NODELIST:?neither SLURM_NODEID nor SLURM_JOB_NODELIST is set}"); do
    if [ "$host" = "${SLURMD_NODENAME:?SLURMD_NODENAME is not set}" ]; then
      echo "$index"
      return
    fi
    index=$((index + 1))
  done
  echo "prolog: $SLURMD_NODENAME is not in the job's node list $SLURM_JOB_NODELIST" >&2
  return 1
}

id=$(node_id)
mkdir -p "$state_dir"
pid_file="$state_dir/moesnapd.job$job.pid"
log_file="$state_dir/moesnapd.job$job.log"

"$bin_dir/moesnapd" --config "$config" --node-id "$id" --check-config > /dev/null

as_job_user=()
if [ "$(id -u)" -eq 0 ] && [ -n "${SLURM_JOB_USER:-}" ] && [ "$SLURM_JOB_USER" != root ]; then
  as_job_user=(runuser -u "$SLURM_JOB_USER" --)
fi
# setsid: the daemon outlives the prolog and is not in the job step's process group.
setsid "${as_job_user[@]}" "$bin_dir/moesnapd" --config "$config" --node-id "$id" \
  < /dev/null >> "$log_file" 2>&1 &
echo $! > "$pid_file"

deadline=$((SECONDS + timeout))
until "$bin_dir/moesnapctl" --socket "$admin_socket" --timeout 2 status > /dev/null 2>&1; do
  if ! kill -0 "$(cat "$pid_file")" 2> /dev/null; then
    echo "prolog: moesnapd for job $job exited at start; its log ($log_file):" >&2
    tail -n 20 "$log_file" >&2
    exit 1
  fi
  if [ $SECONDS -ge $deadline ]; then
    echo "prolog: moesnapd for job $job did not answer on $admin_socket within ${timeout}s" >&2
    exit 1
  fi
  sleep 0.1
done
echo "prolog: moesnapd node $id serving job $job (pid $(cat "$pid_file"))"
