#!/usr/bin/env bash
# Slurm Epilog (slurm.conf: Epilog=/etc/moesnap/slurm/epilog.sh): stops this job's moesnapd on each
# node after the job and removes its pool, whose snapshots belong to the finished job. With
# MOESNAP_KEEP_POOL=1 the pool stays in /dev/shm (a job requeued onto the same nodes restores
# from it). SIGTERM first (queued copies finish), SIGKILL after MOESNAP_STOP_TIMEOUT seconds.
#
# Environment: as the prolog (MOESNAP_ADMIN_SOCKET, MOESNAP_BIN_DIR, MOESNAP_STATE_DIR), and
# MOESNAP_STOP_TIMEOUT (default 30), MOESNAP_KEEP_POOL.
set -euo pipefail

admin_socket=${MOESNAP_ADMIN_SOCKET:-/run/moesnap/admin.sock}
bin_dir=${MOESNAP_BIN_DIR:-/usr/local/bin}
state_dir=${MOESNAP_STATE_DIR:-/run/moesnap}
timeout=${MOESNAP_STOP_TIMEOUT:-30}
job=${SLURM_JOB_ID:?the Slurm epilog runs with SLURM_JOB_ID set}
pid_file="$state_dir/moesnapd.job$job.pid"

if [ ! -f "$pid_file" ]; then
  echo "epilog: no moesnapd was started for job $job"
  exit 0
fi
pid=$(cat "$pid_file")

# Running, and not a zombie its new parent has yet to reap.
running() {
  local state
  state=$(ps -o stat= -p "$1" 2> /dev/null) || return 1
  [[ $state != Z* ]]
}

# The pool's file, asked before the daemon stops (/dev/shm/<pool.name>.data; its journal beside it).
pool_file=$("$bin_dir/moesnapctl" --socket "$admin_socket" --timeout 5 status --json 2> /dev/null |
  sed -n 's/.*"pool_name":"\([^"/]*\)".*/\1/p') || true
pool=${pool_file%.data}

if kill -TERM "$pid" 2> /dev/null; then
  deadline=$((SECONDS + timeout))
  while running "$pid"; do
    if [ $SECONDS -ge $deadline ]; then
      echo "epilog: moesnapd (pid $pid) ignored SIGTERM for ${timeout}s; killing it" >&2
      kill -KILL "$pid" 2> /dev/null || true
      break
    fi
    sleep 0.1
  done
fi
rm -f "$pid_file"

if [ -n "$pool" ] && [ "${MOESNAP_KEEP_POOL:-0}" != 1 ]; then
  rm -f "/dev/shm/$pool.data" "/dev/shm/$pool.journal"
  echo "epilog: stopped moesnapd of job $job and removed its pool /dev/shm/$pool.*"
else
  echo "epilog: stopped moesnapd of job $job${pool:+, pool /dev/shm/$pool.* kept}"
fi
