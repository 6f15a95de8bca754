"""Harmony chat SFT with LoRA: the base frozen, rank-8 adapters on attention and experts.

  # a few minutes on a 2-core CPU, on the tiny model the quick start trains
  python -m gpt_oss_train.train --config=configs/lora_sft.py --workdir=runs/lora_sft \
      --config.checkpoint.init_from=runs/cpu_tiny

  # QLoRA on the published checkpoint: its MXFP4 experts are kept as they are
  python -m gpt_oss_train.train --config=configs/lora_sft.py:gpt-oss-20b --workdir=DIR \
      --config.checkpoint.init_from=/path/to/gpt-oss-20b --config.data.source=chat:FILE

The architecture comes from init_from; without it the adapters train on a random base
of this shape (seed config.seed), which only checks the plumbing. The argument
`gpt-oss-20b` / `gpt-oss-120b` gives the QLoRA setup tools.aot_compile checks:
MXFP4 base, rank 16, sequence 2048, remat, bfloat16 compute.
"""

import os

from gpt_oss_train.config import from_file, model_preset


def get_config(arg: str = ""):
    # configs/sft_chat.py's model and data, with LoRA and a learning rate for adapters
    c = from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft_chat.py"))
    c.lora.update(rank=8, alpha=16.0, targets="q,k,v,o,gate_up,down")
    c.train.update(
        steps=60,
        global_batch_size=8,
        seq_len=128,
        learning_rate=1e-2,
        warmup_steps=5,
        end_lr_ratio=0.1,
        log_every=10,
        loss_chunk_size=128,
    )
    c.checkpoint.update(every=20)
    if arg:
        c.model = model_preset(arg)
        c.dtype = "bfloat16"
        c.remat_policy = "full"
        c.lora.update(rank=16, alpha=32.0, base_format="mxfp4")
        c.train.update(global_batch_size=1, seq_len=2048, learning_rate=2e-4, loss_chunk_size=512)
    return c
