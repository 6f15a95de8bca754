"""Serving gpt-oss on TPU v5e: the runtime config of decode / serve (mesh, dtype, kernels),
sized per model for the smallest slice that holds its weights, KV cache and a full batch.

  python -m gpt_oss_train.serve --checkpoint=/path/to/gpt-oss-120b \
      --config=configs/tpu_v5e_serve.py:gpt-oss-120b --max_slots=64 --max_context=8192

  # the engine's decode step and prefill chunk, compiled for the slice from a CPU
  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_v5e_serve.py:gpt-oss-120b \
      --topology=v5e:4x4 --program=decode --slots=64 --context=8192 --weights=mxfp4

  gpt-oss-120b  v5e:4x4 (16 chips): the 128 experts 16 ways over `expert` (8 a chip, kept
                as MXFP4: 3.8 GiB a chip), the rest bfloat16 and replicated; the decode
                rows split over the same 16 chips, whose tokens meet each chip's experts.
  gpt-oss-20b   v5e:2x2 (4 chips): the 32 experts 4 ways, the same way.

No chip gathers another's weights in a decode step: what crosses the chips is the rows'
activations (the expert-parallel MoE) and nothing else, so the step stays bound by each
chip reading its own weights and cache.
"""

from gpt_oss_train.config import PRESETS, default_config

# model -> expert-parallel ways (= the slice's chips)
EXPERT_WAYS = {"gpt-oss-20b": 4, "gpt-oss-120b": 16}


def get_config(model: str = "gpt-oss-120b"):
    if model not in EXPERT_WAYS:
        raise ValueError(f"configs/tpu_v5e_serve.py:{model}: choose one of {sorted(EXPERT_WAYS)}")
    c = default_config()
    c.model.update(PRESETS[model])
    c.dtype = "bfloat16"
    c.param_dtype = "bfloat16"  # weights kept as served: a decode step reads them all
    c.scan_layers = True
    c.remat_policy = "none"  # nothing is differentiated
    c.kernels.attention = "splash"
    c.moe_impl = "sharded"
    c.mesh.update(data=1, fsdp=1, tensor=1, expert=EXPERT_WAYS[model])
    return c
