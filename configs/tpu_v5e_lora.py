"""QLoRA fine-tuning of gpt-oss on TPU v5e: the published MXFP4 experts kept frozen as
they are (4.25 bits a weight, decoded inside the layer scan), bfloat16 attention and
embeddings, rank-16 adapters, full remat, one sequence per chip.

  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_v5e_lora.py:gpt-oss-20b \
      --topology=v5e:1x1
  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_v5e_lora.py:gpt-oss-120b \
      --topology=v5e:2x4

  python -m gpt_oss_train.train --config=configs/tpu_v5e_lora.py:gpt-oss-20b --workdir=DIR \
      --config.checkpoint.init_from=/path/to/gpt-oss-20b --config.data.source=chat:FILE

The argument picks the model and the slice it is sized for (the frozen base alone is 12.8
GiB a chip for 20b, 11.1 for 120b, so adapters go on attention only: expert adapters and
their Adam state would add 2 GiB):

  gpt-oss-20b   one chip (16 GiB): sequences of 1024 tokens, and XLA's tiled grouped
                matmul, which decodes one expert's weights at a time where megablox
                needs a layer's 32 experts dense (1.5 GiB).
  gpt-oss-120b  v5e:2x4 (8 chips: experts 8 ways over `expert`, 16 a chip, so no chip
                gathers another's expert weights), sequences of 2048, XLA's grouped
                matmul, and the expert-parallel rows in rounds of their balanced share
                (moe_capacity_factor=1: the tokens of all 8 chips meet each chip's
                experts, and a buffer sized for every pair landing on one chip would
                take 8x).

What each compiles to, and the variants that do not fit: docs/AOT.md, "QLoRA memory".
"""

from gpt_oss_train.config import default_config, model_preset

# model -> (expert-parallel ways, chips it is sized for, adapter targets, sequence length)
SLICES = {
    "gpt-oss-20b": (1, 1, "q,k,v,o", 1024),
    "gpt-oss-120b": (8, 8, "q,k,v,o", 2048),
}


def get_config(model: str = "gpt-oss-20b"):
    if model not in SLICES:
        raise ValueError(f"configs/tpu_v5e_lora.py:{model}: choose one of {sorted(SLICES)}")
    expert, chips, targets, seq_len = SLICES[model]
    c = default_config()
    c.model = model_preset(model)
    c.dtype = "bfloat16"
    c.param_dtype = "float32"  # the adapters and their Adam state; the base is MXFP4/bf16
    c.scan_layers = True
    c.remat_policy = "full"
    c.kernels.attention = "splash"
    c.moe_impl = "sharded"
    c.mesh.update(data=1, fsdp=-1, tensor=1, expert=expert)
    c.lora.update(rank=16, alpha=32.0, targets=targets, base_format="mxfp4")
    c.kernels.grouped_matmul = "xla"  # one expert's weights decoded at a time
    c.moe_capacity_factor = 1.0
    c.train.update(
        steps=1000,
        global_batch_size=chips,  # one sequence per chip
        seq_len=seq_len,
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
