#!/usr/bin/env bash
# Run a command as N cooperating JAX processes on this machine (multi-host, simulated):
#   launch/local.sh 2 python -m gpt_oss_train.train --config=configs/cpu_tiny.py --workdir=/tmp/run
# Each process gets JAX_PROCESS_ID/JAX_PROCESS_COUNT and the coordinator address, which
# gpt_oss_train.sharding.initialize_distributed() turns into jax.distributed.initialize.
# CPU processes split the fake devices: set DEVICES_PER_PROCESS (default 4). Output lines
# are prefixed with the process id ([0] ..., [1] ...). If one process fails the others are
# stopped (a survivor would otherwise wait in a collective for its dead peer): they get a
# few seconds to end on their own (a job refused on every process exits by itself), then
# SIGKILL; no SIGTERM, since a checkpoint needs every process and the failed one is gone.
# The script exits with the first failure's status, else 0. SIGINT/SIGTERM to this script
# are passed on as SIGTERM: every process ends its work in order (train saves a checkpoint;
# serve drains its requests, process 0 telling the others when), and the script exits
# when they have, SIGKILLing those still running after STOP_TIMEOUT_S (default 120).
# Process 0 reads this script's standard input (decode --mode=chat < FILE); the others
# get none: process 0 sends them what they need.
set -euo pipefail
n=${1:?usage: launch/local.sh NUM_PROCESSES command...}; shift
port=${COORDINATOR_PORT:-$((20000 + RANDOM % 20000))}
per=${DEVICES_PER_PROCESS:-4}
# A device count already in XLA_FLAGS (e.g. a test harness's) would fight ours.
xla_flags=$(printf '%s' "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g')

# Process 0's standard input: this script's, if it has one (CI may start it with none).
input=/dev/null
if { true < /dev/stdin; } 2>/dev/null; then input=/dev/stdin; fi

pids=()
index_of() {  # the process id of a pid (no associative arrays: macOS ships bash 3.2)
  local i
  for i in "${!pids[@]}"; do if [[ ${pids[$i]} == "$1" ]]; then echo "$i"; fi; done
}
# Waits for every process to end, checking $1 times 0.2 s apart, then SIGKILLs the rest.
wait_then_kill() {
  local pid
  for _ in $(seq 1 "$1"); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    sleep 0.2
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}
stop_deadline=0
stop_all() {
  local pid
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  stop_deadline=$((SECONDS + ${STOP_TIMEOUT_S:-120}))
}
trap stop_all INT TERM

for ((i = 0; i < n; i++)); do
  # `read` rather than sed for the prefix: sed buffers its output when it writes to a pipe.
  JAX_COORDINATOR_ADDRESS="localhost:$port" JAX_PROCESS_COUNT="$n" JAX_PROCESS_ID="$i" \
  JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}" \
  XLA_FLAGS="$xla_flags --xla_force_host_platform_device_count=$per" \
    "$@" < "$( ((i == 0)) && echo "$input" || echo /dev/null)" \
    > >(while IFS= read -r line; do printf '[%s] %s\n' "$i" "$line"; done) 2>&1 &
  pids+=($!)
done

# Poll rather than `wait -n` (bash >= 4.3; macOS ships 3.2): reap each process as it
# ends, and stop the rest as soon as one fails.
status=0
remaining=("${pids[@]}")
while ((${#remaining[@]})); do
  still=()
  for pid in "${remaining[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      still+=("$pid")
    elif wait "$pid"; then
      :
    else
      rc=$?
      if ((status == 0)); then
        status=$rc
        echo "launch/local.sh: process $(index_of "$pid") exited with status $rc; the others" \
          "cannot save a checkpoint without it, so they are stopped without one (a rerun" \
          "resumes from the newest complete checkpoint, if one was saved)" >&2
        wait_then_kill 25  # after a failure, no SIGTERM: no checkpoint is possible
      fi
    fi
  done
  remaining=(${still[@]+"${still[@]}"})
  if ((stop_deadline && SECONDS > stop_deadline)); then
    echo "launch/local.sh: still running ${STOP_TIMEOUT_S:-120} s after SIGTERM; killed" >&2
    for pid in "${remaining[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    stop_deadline=0
  fi
  ((${#remaining[@]})) && sleep 0.2
done
trap - INT TERM
wait  # the output-prefixing readers
exit $status
