"""GRPO of gpt-oss-20b with LoRA on a TPU slice: 16 completions of 1024 new tokens for each
512-token prompt, sampled by the serving engine on the trainer's own mesh and weights (the
MXFP4 base with the trained adapters), then the learner's step on the 1536-token rows.
The argument is the slice (MaxText's gpt-oss GRPO recipe runs on v5p:4x4x4):

  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_grpo.py:v5p \
      --topology=v5p:4x4x4 --program=grpo
  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_grpo.py:v5e \
      --topology=v5e:4x8 --program=grpo

  v5p  64 chips: 4 prompts x 16 completions a step, a row a chip; experts 4 ways
  v5e  32 chips: 2 prompts x 16 completions a step, a row a chip; experts 4 ways

`--program=grpo` compiles the three programs of a step (the learner's train step, the
engine's decode step over every row at the longest context, its prefill chunk) and adds
up what stays resident across them; docs/AOT.md has the figures.
"""

import os

from gpt_oss_train.config import from_file

# slice -> (chips, expert-parallel ways)
SLICES = {"v5p": (64, 4), "v5e": (32, 4)}


def get_config(slice_name: str = "v5p"):
    if slice_name not in SLICES:
        raise ValueError(f"configs/tpu_grpo.py:{slice_name}: choose one of {sorted(SLICES)}")
    chips, expert = SLICES[slice_name]
    # configs/tpu_v5e_lora.py's QLoRA: MXFP4 base, bf16 compute, rank-16 attention adapters
    here = os.path.dirname(os.path.abspath(__file__))
    c = from_file(os.path.join(here, "tpu_v5e_lora.py"), "gpt-oss-20b")
    c.mesh.update(data=1, fsdp=-1, tensor=1, expert=expert)
    c.moe_capacity_factor = 0.0
    c.train.update(
        objective="grpo",
        global_batch_size=chips,  # group_size completions of chips / group_size prompts
        seq_len=512 + 1024,
        learning_rate=1e-5,
        warmup_steps=10,
        loss_chunk_size=512,
    )
    c.rl.update(group_size=16, max_prompt_tokens=512, max_new_tokens=1024, temperature=1.0)
    c.data.update(source="rl:reasoning_gym:basic_arithmetic")
    return c
