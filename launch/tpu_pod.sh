#!/usr/bin/env bash
# Run the same command on every worker of a Cloud TPU VM pod slice.
#   TPU_NAME=my-v5e-256 ZONE=us-west4-a PROJECT=my-proj \
#     launch/tpu_pod.sh python -m gpt_oss_train.train --config=configs/tpu_v5e.py --workdir=gs://b/run
# Steps, on every worker: unpack this checkout (git HEAD) into ~/gpt_oss_train; install it
# with pip when INSTALL=1 (the default; INSTALL=0 skips it once the workers have it); stop
# what the previous launch of this script started there, and nothing else (its process
# group, recorded in ~/gpt_oss_train/launch.pid with the start time that tells it from a
# later process given the same pid: SIGTERM, which saves a checkpoint, then SIGKILL after
# STOP_TIMEOUT_S, default 120); refuse if another process still holds the TPU; run the
# command (jax.distributed.initialize() auto-detects the pod), logging to
# ~/gpt_oss_train_worker.log. Fails if any worker fails.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${PROJECT:?set PROJECT}"
[ $# -gt 0 ] || { echo "usage: $0 command..." >&2; exit 2; }
install=${INSTALL:-1}
[[ $install == 0 || $install == 1 ]] || { echo "INSTALL must be 0 or 1, got $install" >&2; exit 2; }
stop_timeout=${STOP_TIMEOUT_S:-120}
repo=$(cd "$(dirname "$0")/.." && pwd)
tarball=$(mktemp /tmp/gpt_oss_train.XXXX.tgz)
git -C "$repo" archive --format=tar.gz -o "$tarball" HEAD
gc() { gcloud compute tpus tpu-vm "$@" --zone="$ZONE" --project="$PROJECT"; }
gc scp "$tarball" "$TPU_NAME:/tmp/gpt_oss_train.tgz" --worker=all
cmd=$(printf '%q ' "$@")
# The MoE's grouped-matmul backward needs a little more on-chip scratch than libtpu's
# default 16 MiB at gpt-oss sizes (gpt_oss_train.tools.aot_compile reports it); 64 MiB is safe.
libtpu_args=${LIBTPU_INIT_ARGS:---xla_tpu_scoped_vmem_limit_kib=65536}
# Runs on each worker. $$ is the remote shell: ssh makes it a session (and group) leader,
# so its group is exactly this launch's processes.
remote=$(cat <<EOF
set -eo pipefail
mkdir -p ~/gpt_oss_train && tar xzf /tmp/gpt_oss_train.tgz -C ~/gpt_oss_train
cd ~/gpt_oss_train
if [ $install = 1 ]; then
  echo "installing gpt_oss_train (INSTALL=0 skips this)"; python3 -m pip install -q -e '.[tpu]'
fi
start_of() { cut -d' ' -f22 "/proc/\$1/stat" 2>/dev/null || true; }
if [ -f launch.pid ]; then
  read -r old started < launch.pid
  if [ -n "\$old" ] && [ "\$(start_of "\$old")" = "\$started" ]; then
    echo "stopping the previous launch (process group \$old)"
    kill -TERM -- "-\$old" 2>/dev/null || true
    for _ in \$(seq 1 $((stop_timeout * 5))); do
      kill -0 -- "-\$old" 2>/dev/null || break
      sleep 0.2
    done
    kill -KILL -- "-\$old" 2>/dev/null || true
  fi
fi
holders=\$(lsof -t /dev/vfio/* /dev/accel* 2>/dev/null | sort -u | tr '\n' ' ' || true)
if [ -n "\$holders" ]; then
  echo "the TPU is in use by pids \$holders, not started by this script: stop them first" >&2
  exit 1
fi
rm -f /tmp/libtpu_lockfile 2>/dev/null || sudo rm -f /tmp/libtpu_lockfile
echo "\$\$ \$(start_of \$\$)" > launch.pid
LIBTPU_INIT_ARGS='$libtpu_args' $cmd 2>&1 | tee ~/gpt_oss_train_worker.log
EOF
)
gc ssh "$TPU_NAME" --worker=all --command="$remote"
