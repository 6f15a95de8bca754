"""GPT-OSS on NVIDIA H100s.

Default: gpt-oss-20b on one 8 x H100 node (80 GiB each): 251 GB of float32 params + Adam
state, FSDP over the 8 GPUs (31 GB each) plus gradients (10 GB), with full remat and
blockwise attention for activations. For several nodes, launch/slurm_gpu.sh runs the same
config on every node; the -1 FSDP axis grows with the device count.
`--config=configs/gpu_h100.py:small` trains the small shape on a single GPU.
"""

from gpt_oss_train.config import PRESETS, default_config


def get_config(model: str = "gpt-oss-20b"):
    c = default_config()
    c.model.update(PRESETS[model])
    c.dtype = "bfloat16"
    c.remat_policy = "full" if model.startswith("gpt-oss") else "save_dots_no_batch"
    c.kernels.attention = "blockwise"
    c.moe_impl = "ragged"
    c.mesh.update(data=1, fsdp=-1, tensor=1, expert=1)
    c.train.update(
        steps=10000,
        global_batch_size=64,
        seq_len=4096,
        learning_rate=3e-4,
        warmup_steps=500,
        log_every=10,
        loss_chunk_size=512,
        eval_every=1000,
    )
    if not model.startswith("gpt-oss"):
        c.train.update(global_batch_size=16, seq_len=2048)
    c.checkpoint.update(every=500, keep=3)
    c.data.update(source="stdlib", num_workers=4)
    return c
