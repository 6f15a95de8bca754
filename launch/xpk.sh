#!/usr/bin/env bash
# Submit to a GKE cluster with xpk (a JobSet: one pod per TPU host, same command in each).
#   CLUSTER=my-cluster TPU_TYPE=v5litepod-256 IMAGE=gcr.io/p/gpt-oss-train:latest \
#     launch/xpk.sh python -m gpt_oss_train.train --config=configs/tpu_v5e.py --workdir=gs://b/run
# The image must contain this checkout installed with `pip install -e .[tpu]`.
set -euo pipefail
: "${CLUSTER:?set CLUSTER}" "${TPU_TYPE:?set TPU_TYPE}" "${IMAGE:?set IMAGE}"
[ $# -gt 0 ] || { echo "usage: $0 command..." >&2; exit 2; }
workload=${WORKLOAD:-gpt-oss-$(date +%Y%m%d-%H%M%S)}
# See tpu_pod.sh: the grouped-matmul backward needs more on-chip scratch than the default.
libtpu_args=${LIBTPU_INIT_ARGS:---xla_tpu_scoped_vmem_limit_kib=65536}
xpk workload create --cluster="$CLUSTER" --workload="$workload" --tpu-type="$TPU_TYPE" \
  --num-slices="${NUM_SLICES:-1}" --docker-image="$IMAGE" --command="LIBTPU_INIT_ARGS='$libtpu_args' $(printf '%q ' "$@")"
echo "submitted $workload; logs: xpk workload list --cluster=$CLUSTER"
