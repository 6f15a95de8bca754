#!/usr/bin/env bash
# Run a command as N cooperating JAX processes on this machine (multi-host, simulated):
#   launch/local.sh 2 python -m gpt_oss_train.train --config=configs/cpu_tiny.py --workdir=/tmp/run
# Each process gets JAX_PROCESS_ID/JAX_PROCESS_COUNT and the coordinator address, which
# gpt_oss_train.sharding.initialize_distributed() turns into jax.distributed.initialize.
# CPU processes split the fake devices: set DEVICES_PER_PROCESS (default 4).
set -euo pipefail
n=${1:?usage: launch/local.sh NUM_PROCESSES command...}; shift
port=${COORDINATOR_PORT:-$((20000 + RANDOM % 20000))}
per=${DEVICES_PER_PROCESS:-4}
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT INT TERM
for ((i = 0; i < n; i++)); do
  JAX_COORDINATOR_ADDRESS="localhost:$port" JAX_PROCESS_COUNT="$n" JAX_PROCESS_ID="$i" \
  JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$per" \
    "$@" > >(sed "s/^/[$i] /") 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
trap - EXIT
exit $status
