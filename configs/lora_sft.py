"""Harmony chat SFT with LoRA: the base frozen, rank-8 adapters on attention and experts.

  # a few minutes on a 2-core CPU, on the tiny model the quick start trains
  python -m gpt_oss_train.train --config=configs/lora_sft.py --workdir=runs/lora_sft \
      --config.checkpoint.init_from=runs/cpu_tiny

  # QLoRA on the published checkpoint: its MXFP4 experts are kept as they are
  python -m gpt_oss_train.train --config=configs/lora_sft.py:gpt-oss-20b --workdir=DIR \
      --config.checkpoint.init_from=/path/to/gpt-oss-20b --config.data.source=chat:FILE

The architecture comes from init_from; without it the adapters train on a random base
of this shape (seed config.seed), which only checks the plumbing. The argument
`gpt-oss-20b` / `gpt-oss-120b` gives the QLoRA setup tools/aot_compile.py checks:
MXFP4 base, rank 16, sequence 2048, remat, bfloat16 compute.
"""

from gpt_oss_train.config import default_config, model_preset


def get_config(arg: str = ""):
    c = default_config()
    c.model.update(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=4,
        experts_per_token=2,
        intermediate_size=64,
        sliding_window=32,
    )
    c.dtype = "float32"  # CPUs have no fast bfloat16 matmul
    c.remat_policy = "none"
    c.lora.update(rank=8, alpha=16.0, targets="q,k,v,o,gate_up,down")
    c.train.update(
        steps=60,
        global_batch_size=8,
        seq_len=128,
        learning_rate=1e-2,
        warmup_steps=5,
        end_lr_ratio=0.1,
        weight_decay=0.0,
        log_every=10,
        loss_chunk_size=128,
        aux_loss_coef=0.0,
    )
    c.checkpoint.update(every=20, keep=2)
    c.data.update(source="chat:data/sample_chat.jsonl")
    if arg:
        c.model = model_preset(arg)
        c.dtype = "bfloat16"
        c.remat_policy = "full"
        c.lora.update(rank=16, alpha=32.0, base_format="mxfp4")
        c.train.update(global_batch_size=1, seq_len=2048, learning_rate=2e-4, loss_chunk_size=512)
    return c
