"""Attention of a decode step's few queries over one layer of the stacked KV cache as one
CPU custom call (decode_attention.cc), reading keys and values in place: XLA's attention
over the cache copies and transposes the layer's whole cache first, every step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train import sharding
from gpt_oss_train.model import bit_moves
from gpt_oss_train.model.cpu_kernels import build

TARGET = "gpt_oss_decode_attention"
MAX_QUERIES = 16  # queries per row (a decode step has 1; a prefill chunk takes XLA's path)


def available() -> bool:
    return build.load("decode_attention.cc", ((TARGET, "GptOssDecodeAttention"),))


def applies(q, cache) -> bool:
    """CPU, one device, float32 or bfloat16 queries and cache (not int8), a few queries."""
    ctx = sharding.active()
    return (
        q.shape[1] <= MAX_QUERIES
        and q.dtype in build.DTYPES
        and cache.k_scale is None
        and isinstance(cache.k, jax.Array)
        and bit_moves.value_dtype(cache.k.dtype) in build.DTYPES
        and sharding.platform() == "cpu"
        and (ctx is None or ctx[0].size == 1)
        and available()
    )


def decode_attention(q, cache, layer, sinks, q_pos, window: int | None):
    """q [b, s, n, h] over layer `layer` of the stacked cache (a KVCache of [L, b, t, ...]
    arrays) -> [b, s, n, h] in q's dtype: attention.xla_attention with the visibility of
    attention.visibility_mask (no segments), computed in place."""
    if not available():
        raise RuntimeError(f"the CPU kernel {TARGET} could not be built (see the log)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32),
        cache.k,
        cache.v,
        cache.pos,
        q_pos.astype(jnp.int32),
        sinks.astype(jnp.float32),
        jnp.asarray(layer, jnp.int32),
        window=np.int64(window or 0),
    )
    return out.astype(q.dtype)
