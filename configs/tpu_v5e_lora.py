"""QLoRA fine-tuning of gpt-oss on TPU v5e: the published MXFP4 experts kept frozen as
they are (4.25 bits a weight, decoded one layer at a time inside the scan), bfloat16
attention and embeddings, rank-16 adapters on attention and experts, sequence 2048,
full remat, one sequence per chip.

  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_v5e_lora.py:gpt-oss-20b \
      --topology=v5e:1x1
  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_v5e_lora.py:gpt-oss-120b \
      --topology=v5e:2x4

  python -m gpt_oss_train.train --config=configs/tpu_v5e_lora.py:gpt-oss-20b --workdir=DIR \
      --config.checkpoint.init_from=/path/to/gpt-oss-20b --config.data.source=chat:FILE

The argument picks the model and the slice it is sized for: gpt-oss-20b on one chip,
gpt-oss-120b on v5e:2x4 (8 chips: experts 4 ways over `expert`, everything 2 ways FSDP).
Measured figures: docs/PERFORMANCE.md, "LoRA / QLoRA memory".
"""

from gpt_oss_train.config import default_config, model_preset

# model -> (expert-parallel ways, chips it is sized for)
SLICES = {"gpt-oss-20b": (1, 1), "gpt-oss-120b": (4, 8)}


def get_config(model: str = "gpt-oss-20b"):
    if model not in SLICES:
        raise ValueError(f"configs/tpu_v5e_lora.py:{model}: choose one of {sorted(SLICES)}")
    expert, chips = SLICES[model]
    c = default_config()
    c.model = model_preset(model)
    c.dtype = "bfloat16"
    c.param_dtype = "float32"  # the adapters and their Adam state; the base is MXFP4/bf16
    c.scan_layers = True
    c.remat_policy = "full"
    c.kernels.attention = "splash"
    c.moe_impl = "sharded"
    c.mesh.update(data=1, fsdp=-1, tensor=1, expert=expert)
    c.lora.update(rank=16, alpha=32.0, targets="q,k,v,o,gate_up,down", base_format="mxfp4")
    c.train.update(
        steps=1000,
        global_batch_size=chips,  # one sequence of 2048 tokens per chip
        seq_len=2048,
        learning_rate=2e-4,
        warmup_steps=20,
        weight_decay=0.0,
        log_every=10,
        loss_chunk_size=512,
        eval_every=0,
    )
    c.checkpoint.update(every=200, keep=3)
    c.data.update(source="chat:data/sample_chat.jsonl")
    return c
