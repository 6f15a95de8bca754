"""gpt-oss on TPU v6e (Trillium: 32 GiB of HBM and 918 bf16 TFLOP/s a chip).

  gpt-oss-20b   v6e-64 (8x8): experts 4 ways over `expert` (8 a chip), FSDP 16.
  gpt-oss-120b  v6e-256 (16x16): experts 16 ways (8 a chip), FSDP 16.

One sequence of 4096 tokens a chip, tokens to their experts by ragged all-to-all (the
TPU default; libtpu compiles it for v6e, not for v5e), the unembedding gathered once per
loss (train.loss_gather_once). The 120b keeps XLA's gated activation, whose backward
frees one gradient before writing the other: the one-pass kernel does not fit there.

configs/tpu_v5e.py's model, precision, remat and kernels otherwise. Checked from a CPU
with the compiler the pod runs (docs/AOT.md has the memory a chip and step estimates):
  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_v6e.py --topology=v6e:8x8
  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_v6e.py:gpt-oss-120b \
      --topology=v6e:16x16
"""

import os

from gpt_oss_train.config import from_file

# model -> (expert-parallel ways, global batch: sequences a step)
SLICES = {"gpt-oss-20b": (4, 64), "gpt-oss-120b": (16, 256)}


def get_config(model: str = "gpt-oss-20b"):
    if model not in SLICES:
        raise ValueError(f"configs/tpu_v6e.py:{model}: choose one of {sorted(SLICES)}")
    expert, batch = SLICES[model]
    c = from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_v5e.py"), model)
    c.mesh.update(data=1, fsdp=-1, tensor=1, expert=expert)
    c.train.update(global_batch_size=batch, loss_gather_once=True)
    if model == "gpt-oss-120b":
        # The activation's one-pass backward (the TPU default) holds both gradients at once:
        # 33.92 GiB, over the chip. XLA's two passes fit, 0.45 GiB to spare.
        c.kernels.gated_activation = "xla"
    return c
