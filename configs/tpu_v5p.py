"""gpt-oss-120b pre-training / fine-tuning on a TPU v5p-1024 pod slice (8x8x8, 512 chips).

116.8B params x (4 B param + 8 B Adam) = 1.4 TB of state. Experts shard 16 ways over
`expert` (128 experts -> 8 per chip) and 32 ways FSDP; one sequence of 4096 tokens per
chip, full remat, splash attention. Tokens reach their experts by ragged all-to-all (the
`expert_parallel` op's TPU default: v5p compiles it), and the loss gathers the
unembedding once (train.loss_gather_once: 95 GiB of HBM leave room for it).

Checked from a CPU with the compiler the pod runs (docs/AOT.md has the figures):
  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_v5p.py --topology=v5p:8x8x8
Pass `:gpt-oss-20b` for the 20b shape on the same slice (data 2 x fsdp 64 x expert 4).
"""

import os

from gpt_oss_train.config import from_file


def get_config(model: str = "gpt-oss-120b"):
    # configs/tpu_v5e.py's model, precision, remat and kernels, on the larger slice
    c = from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_v5e.py"), model)
    if model == "gpt-oss-120b":
        c.mesh.update(data=1, fsdp=-1, tensor=1, expert=16)
    else:  # 2880 does not divide by 128: FSDP 64 ways as on v5e:16x16, two data replicas
        c.mesh.update(data=2, fsdp=64, tensor=1, expert=4)
    c.train.update(global_batch_size=512, loss_gather_once=True)
    return c
