"""C++ kernels for CPUs, called through XLA's FFI where XLA:CPU's own lowering is slow,
built for this machine's CPU on first use (build.py), each with a Python module that
wraps the custom calls and says which operands it takes:

  self_attention    self-attention forward and backward, online softmax (AVX-512)
  decode_attention  a step's queries over one layer of the stacked KV cache, in place
  grouped_matmul    the MoE's grouped matmul and its backward in bf16 dot products
                    (AVX512-BF16); also the projections' and the loss's products
  glu               the experts' gated activation and its bias gradients (AVX512-BF16)
  moe_decode        a decode batch's MoE layer, each chosen expert read once, in place
  rows_matmul       a few rows times a large matrix (decode's projections, unembedding)
  cross_entropy     the loss chunk's softmax and its gradient (AVX512-BF16)
  adamw             the AdamW step, one pass per parameter (AVX-512)

matmul.py and fused_adamw.py put them behind the `matmul` and `optimizer_update` ops.
Besides kernels, the CPU's workarounds live here too: huge_pages.py (weights on 2 MB
pages); the KV cache's uint16 storage of bfloat16 is the CPU's entry in the registry's
platform facts (kernels/platforms.py).
"""

from __future__ import annotations

import jax.numpy as jnp

from gpt_oss_train import sharding

# What the kernels read their weights and KV caches in, and the compute dtypes they stand
# in for: bfloat16 is widened to float32 as it is read (stream_rows.h); the arithmetic and
# the results are float32.
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

# Each kernel's module under kernels/cpu/ (the pytest summary and `describe` list them).
SOURCES = (
    "self_attention",
    "decode_attention",
    "grouped_matmul",
    "glu",
    "moe_decode",
    "rows_matmul",
    "cross_entropy",
    "adamw",
)


def one_device() -> bool:
    """The kernels run on one CPU device: on a mesh of several, XLA would gather a custom
    call's operands onto every device, so its own partitioned lowering runs instead."""
    ctx = sharding.active()
    return ctx is None or ctx[0].size == 1
