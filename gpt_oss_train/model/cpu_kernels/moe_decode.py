"""The decode-time MoE layer as one CPU custom call (moe_decode.cc): each chosen expert's
matrices read once, in place, from the layer-stacked weights, on all cores.

It takes over from `moe.pairwise_ffn` and the tiled grouped matmul where XLA's lowering
is slowest: float32 or bfloat16 streamed weights (model/streamed_weights.py: CPU
inference on one device), no LoRA, up to MAX_PAIRS (token, choice) pairs; figures in
docs/PERFORMANCE.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train import sharding
from gpt_oss_train.model import streamed_weights
from gpt_oss_train.model.cpu_kernels import build

TARGET = "gpt_oss_moe_decode"
# Past this many (token, choice) pairs (about 8 rows per expert at 32 experts) the tiled
# grouped matmul's XLA dots are as fast (tools/moe_benchmark.py --mode=decode).
MAX_PAIRS = 128


def available() -> bool:
    return build.load("moe_decode.cc", ((TARGET, "GptOssMoeDecode"),))


def applies(tokens: int, k: int, w, dtype) -> bool:
    """Whether `moe_decode` can run this layer: CPU, float32 or bfloat16 compute, streamed
    plain arrays of either."""
    views = [getattr(w, n) for n in streamed_weights.EXPERTS]
    return (
        tokens * k <= MAX_PAIRS
        and w.lora is None
        and jnp.dtype(dtype) in build.DTYPES
        and all(isinstance(v, streamed_weights.LayerView) for v in views)
        and all(isinstance(v.stack, jax.Array) and v.stack.dtype in build.DTYPES for v in views)
        and sharding.platform() == "cpu"
        and available()
    )


def moe_decode(x_td, weights_tk, idx_tk, w, *, limit: float, alpha: float):
    """sum_j weights[t, j] * expert_{idx[t, j]}(x_t), float32 [T, D]; w's three matrices
    are LayerViews of one layer (streamed_weights.put gives them the same index)."""
    if not available():
        raise RuntimeError(f"the CPU kernel {TARGET} could not be built (see the log)")
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
