"""gpt-oss-20b pre-training / fine-tuning on a TPU v5e-256 pod slice (16x16).

Memory per chip (16 GiB HBM): 20.9B params x (4 B param + 8 B Adam) = 251 GB of state,
sharded 256 ways = 0.98 GB/chip; gradients in float32 another 0.33 GB; activations with
full remat at 1 sequence of 4096 tokens per chip fit in the rest. Experts shard 8 ways
over `expert` (32 experts -> 4 per chip), everything else FSDP over the other 32.
Check it from a CPU before booking the pod:
  python tools/aot_compile.py --config=configs/tpu_v5e.py --topology=v5e:16x16
Pass `:gpt-oss-120b` after the file name for the 120b shape (use a v5e-512 or larger).
"""

from gpt_oss_train.config import PRESETS, default_config


def get_config(model: str = "gpt-oss-20b"):
    c = default_config()
    c.model.update(PRESETS[model])
    c.dtype = "bfloat16"
    c.param_dtype = "float32"
    c.scan_layers = True
    c.remat_policy = "full"
    c.attention_impl = "splash"
    c.moe_impl = "sharded"
    c.mesh.update(data=1, fsdp=-1, tensor=1, expert=8)
    c.train.update(
        steps=10000,
        global_batch_size=256,
        seq_len=4096,
        learning_rate=3e-4,
        warmup_steps=500,
        log_every=10,
        loss_chunk_size=512,
        eval_every=1000,
    )
    c.checkpoint.update(every=500, keep=3)
    c.data.update(source="tfds:c4/en:3.1.0:train", num_workers=4)
    return c
