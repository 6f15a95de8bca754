"""The decode-time MoE layer as one CPU custom call (moe_decode.cc): each chosen expert's
matrices read once, in place, from the layer-stacked weights, on all cores.

The `moe_decode` op's `cpu` implementation, in place of XLA's pair loop
(xla/experts.pairwise) and the tiled grouped matmul where their lowering is slowest:
float32 or bfloat16 streamed weights (LayerViews: CPU inference on one device), no LoRA,
up to MAX_PAIRS (token, choice) pairs; figures in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train.arrays.layer_views import LayerView
from gpt_oss_train.kernels.cpu import DTYPES, build

TARGET = "gpt_oss_moe_decode"
# Past this many (token, choice) pairs (about 8 rows per expert at 32 experts) the tiled
# grouped matmul's XLA dots are as fast (python -m gpt_oss_train.tools.bench_moe --mode=decode).
MAX_PAIRS = 128


HANDLERS = ((TARGET, "GptOssMoeDecode"),)
EXPERTS = ("wi_gate", "wi_up", "wo")  # the matrices read from their stacks


def unavailable(platform: str = "cpu") -> str | None:
    return build.unavailable("moe_decode.cc", HANDLERS)


def accepts(x_td, weights_tk, idx_tk, w, *, limit, alpha, dtype) -> bool:
    """Float32 or bfloat16 compute, streamed plain arrays of either, no LoRA, a few pairs."""
    views = [getattr(w, n) for n in EXPERTS]
    return (
        idx_tk.size <= MAX_PAIRS
        and w.lora is None
        and jnp.dtype(dtype) in DTYPES
        and all(isinstance(v, LayerView) for v in views)
        and all(isinstance(v.stack, jax.Array) and v.stack.dtype in DTYPES for v in views)
    )


def moe_decode(x_td, weights_tk, idx_tk, w, *, limit: float, alpha: float, dtype=None):
    """sum_j weights[t, j] * expert_{idx[t, j]}(x_t), float32 [T, D]; w's three matrices
    are LayerViews of one layer (streamed_weights.put gives them the same index)."""
    build.require("moe_decode.cc", HANDLERS)
    f32 = jnp.float32
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x_td.shape, f32))
    return call(
        x_td.astype(f32),
        weights_tk.astype(f32),
        idx_tk.astype(jnp.int32),
        jnp.asarray(w.wi_gate.layer, jnp.int32),
        w.wi_gate.stack,
        w.bi_gate.astype(f32),
        w.wi_up.stack,
        w.bi_up.astype(f32),
        w.wo.stack,
        w.bo.astype(f32),
        limit=np.float32(limit),
        alpha=np.float32(alpha),
    )
