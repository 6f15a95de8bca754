"""Self-attention over whole sequences (training, prefill) as CPU custom calls on CPUs
with AVX-512 (self_attention.cc): blocks of queries against blocks of keys with an online
softmax, forward and backward, float32 arithmetic on float32 or bfloat16 operands. The
same results as xla/attention.py (its visibility, sinks and grouped-query heads): the
`attention` op's `cpu` implementation. Figures in docs/PERFORMANCE.md."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train.kernels.cpu import DTYPES, build, one_device

TARGET = "gpt_oss_self_attention"
GRAD_TARGET = "gpt_oss_self_attention_grad"
CPU_FLAG = "avx512f"
HANDLERS = ((TARGET, "GptOssSelfAttention"), (GRAD_TARGET, "GptOssSelfAttentionGrad"))


def unavailable(platform: str = "cpu") -> str | None:
    return build.unavailable("self_attention.cc", HANDLERS, CPU_FLAG)


def accepts(q, k, v, sinks, *, positions, segment_ids, window, block) -> bool:
    """One device, float32 or bfloat16 heads of a multiple of 16."""
    return q.dtype in DTYPES and k.dtype in DTYPES and q.shape[-1] % 16 == 0 and one_device()


def self_attention(q, k, v, sinks, *, positions, segment_ids, window, block):
    """q [b, s, n, h], k/v [b, s, kh, h] of one sequence per row, positions and segment
    ids [b, s] -> [b, s, n, h] in q's dtype; differentiable in q, k, v and the sinks."""
    build.require("self_attention.cc", HANDLERS, CPU_FLAG)
    pos, seg = positions.astype(jnp.int32), segment_ids.astype(jnp.int32)
    return _attention(q, k, v, sinks, pos, seg, window or 0)


def _forward(q, k, v, sinks, pos, seg, window):
    b, s, n, _ = q.shape
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((b, n, s), jnp.float32))
    call = jax.ffi.ffi_call(TARGET, out)
    return call(q, k, v, sinks.astype(jnp.float32), pos, seg, window=np.int64(window))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, sinks, pos, seg, window):
    return _forward(q, k, v, sinks, pos, seg, window)[0].astype(q.dtype)


def _fwd(q, k, v, sinks, pos, seg, window):
    out, lse = _forward(q, k, v, sinks, pos, seg, window)
    return out.astype(q.dtype), (q, k, v, sinks, pos, seg, out, lse)


def _bwd(window, res, dout):
    q, k, v, sinks, pos, seg, out, lse = res
    b, _, n, _ = q.shape
    f32 = lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32)
    shapes = (f32(q), f32(k), f32(v), jax.ShapeDtypeStruct((b, n), jnp.float32))
    call = jax.ffi.ffi_call(GRAD_TARGET, shapes)
    dq, dk, dv, dsinks = call(
        q, k, v, sinks.astype(jnp.float32), pos, seg, out, lse, dout, window=np.int64(window)
    )
    cast = lambda g, like: g.astype(like.dtype)
    return cast(dq, q), cast(dk, k), cast(dv, v), cast(dsinks.sum(0), sinks), None, None


_attention.defvjp(_fwd, _bwd)
