"""Attention of a decode step's few queries over one layer of the stacked KV cache as one
CPU custom call (decode_attention.cc), reading keys and values in place: XLA's attention
over the cache copies and transposes the layer's whole cache first, every step. The
`cache_attention` op's `cpu` implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train.arrays import bit_moves
from gpt_oss_train.kernels.cpu import DTYPES, build, one_device

TARGET = "gpt_oss_decode_attention"
MAX_QUERIES = 16  # queries per row (a decode step has 1; a prefill chunk takes XLA's path)


HANDLERS = ((TARGET, "GptOssDecodeAttention"),)


def unavailable(platform: str = "cpu") -> str | None:
    return build.unavailable("decode_attention.cc", HANDLERS)


def accepts(q, cache, layer, sinks, *, positions, window) -> bool:
    """One device, float32 or bfloat16 queries and cache (not int8), a few queries."""
    return (
        q.shape[1] <= MAX_QUERIES
        and q.dtype in DTYPES
        and cache.k_scale is None
        and isinstance(cache.k, jax.Array)
        and bit_moves.value_dtype(cache.k.dtype) in DTYPES
        and one_device()
    )


def cache_attention(q, cache, layer, sinks, *, positions, window):
    return decode_attention(q, cache, layer, sinks, positions, window)


def decode_attention(q, cache, layer, sinks, q_pos, window: int | None):
    """q [b, s, n, h] over layer `layer` of the stacked cache (a KVCache of [L, b, t, ...]
    arrays) -> [b, s, n, h] in q's dtype: xla/attention.cache_attention's result,
    computed in place."""
    build.require("decode_attention.cc", HANDLERS)
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
