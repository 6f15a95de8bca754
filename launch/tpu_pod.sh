#!/usr/bin/env bash
# Run the same command on every worker of a Cloud TPU VM pod slice.
#   TPU_NAME=my-v5e-256 ZONE=us-west4-a PROJECT=my-proj \
#     launch/tpu_pod.sh python -m gpt_oss_train.train --config=configs/tpu_v5e.py --workdir=gs://b/run
# Steps: check the variables, copy this checkout to every worker, install it, free the
# TPU from stale processes, run the command everywhere (jax.distributed.initialize()
# auto-detects the pod), keep per-worker logs, and fail if any worker fails.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${PROJECT:?set PROJECT}"
[ $# -gt 0 ] || { echo "usage: $0 command..." >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
tarball=$(mktemp /tmp/gpt_oss_train.XXXX.tgz)
git -C "$repo" archive --format=tar.gz -o "$tarball" HEAD
gc() { gcloud compute tpus tpu-vm "$@" --zone="$ZONE" --project="$PROJECT"; }
gc scp "$tarball" "$TPU_NAME:/tmp/gpt_oss_train.tgz" --worker=all
cmd=$(printf '%q ' "$@")
# The MoE's grouped-matmul backward needs a little more on-chip scratch than libtpu's
# default 16 MiB at gpt-oss sizes (tools/aot_compile.py reports it); 64 MiB is safe.
libtpu_args=${LIBTPU_INIT_ARGS:---xla_tpu_scoped_vmem_limit_kib=65536}
remote="set -e; mkdir -p ~/gpt_oss_train && tar xzf /tmp/gpt_oss_train.tgz -C ~/gpt_oss_train
cd ~/gpt_oss_train && python3 -m pip install -q -e '.[tpu]'
sudo lsof -t /dev/vfio/* /dev/accel* 2>/dev/null | xargs -r sudo kill -9 || true
sudo rm -f /tmp/libtpu_lockfile
LIBTPU_INIT_ARGS='$libtpu_args' $cmd 2>&1 | tee ~/gpt_oss_train_worker.log"
gc ssh "$TPU_NAME" --worker=all --command="$remote"
