"""gpt-oss-20b pre-training / fine-tuning on a TPU v5e-256 pod slice (16x16).

20.9B params x (4 B param + 8 B Adam) = 251 GB of state. Experts shard 4 ways over
`expert` (32 experts -> 8 per chip) and 64 ways FSDP; the other weights shard FSDP 64
ways (2880 does not divide by 256, so the `expert` axis cannot join). One sequence of
4096 tokens per chip, full remat, splash attention, expert-parallel MoE in rounds of a
capacity, the unembedding gathered once for the loss (train.loss_gather_once).

Check it from a CPU with the compiler the pod runs (the launch scripts' 64 MiB
scoped-VMEM limit); its memory a chip and estimated step time are in docs/AOT.md:
  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_v5e.py --topology=v5e:16x16
`:gpt-oss-120b` gives the 120b shape; configs/tpu_v5p.py runs it on v5p:8x8x8.
"""

from gpt_oss_train.config import PRESETS, default_config


def get_config(model: str = "gpt-oss-20b"):
    c = default_config()
    c.model.update(PRESETS[model])
    c.dtype = "bfloat16"
    c.param_dtype = "float32"
    c.scan_layers = True
    c.remat_policy = "full"
    c.kernels.attention = "splash"
    c.moe_impl = "sharded"
    # Each shard's expert rows in buffers of 1.25x its balanced share, not of every pair
    # landing on it (4x here, 16x for the 120b on v5p): rounds past the first run only
    # for the rows past that, so no token is dropped (docs/AOT.md, "Training steps").
    c.moe_capacity_factor = 1.25
    c.mesh.update(data=1, fsdp=-1, tensor=1, expert=4)
    c.train.update(
        steps=10000,
        global_batch_size=256,
        seq_len=4096,
        learning_rate=3e-4,
        warmup_steps=500,
        log_every=10,
        loss_gather_once=True,
        eval_every=1000,
    )
    c.checkpoint.update(every=500, keep=3)
    c.data.update(source="tfds:c4/en:3.1.0:train", num_workers=4)
    return c
