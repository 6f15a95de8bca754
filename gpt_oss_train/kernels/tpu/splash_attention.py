"""TPU splash attention (JAX's Pallas kernel), which takes the sinks itself, forward and
gradient: the `attention` op's `splash` implementation.

Causal by index within the sequence plus segment ids: valid for training and prefill of
whole sequences, where positions equal indices within each segment. A Mosaic kernel
cannot be partitioned by XLA, so under a mesh it runs in `shard_map` over the batch and
head axes of the logical rules (each device: its rows, its heads, the whole sequence);
rules that shard the sequence or head_dim, or query and KV heads differently, and
sequences that are not whole 128-position blocks, leave the XLA reference in its place
(`accepts`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gpt_oss_train import sharding


def _specs(q, k):
    mesh, rules = sharding.active()
    spec = lambda names, a: sharding.fit_spec(sharding.logical_to_spec(names, rules), a.shape, mesh)
    return spec(("batch", "length", "heads", "head_dim"), q), spec(
        ("batch", "length", "kv_heads", "head_dim"), k
    )


# The kernel's query and key blocks (splash's defaults): a sequence must be whole blocks.
BLOCK = 128


def accepts(q, k, v, sinks, *, positions, segment_ids, window, block) -> bool:
    """Whole blocks of sequence, and whole sequences and heads on each device (see the
    module docstring)."""
    if q.shape[1] % BLOCK:
        return False
    if sharding.active() is None:
        return True
    qspec, kspec = _specs(q, k)
    split = lambda entry: sharding.split_axes(entry, sharding.active()[0])
    return not split(qspec[1]) and not split(qspec[3]) and kspec[2] == qspec[2]


def self_attention(q, k, v, sinks, *, positions, segment_ids, window, block):
    sinks = sinks.astype(jnp.float32)
    if sharding.active() is None:
        return _splash_local(q, k, v, segment_ids, sinks, window)
    mesh, _ = sharding.active()
    qspec, kspec = _specs(q, k)
    fn = jax.shard_map(
        lambda q, k, v, seg, snk: _splash_local(q, k, v, seg, snk, window),
        mesh=mesh,
        in_specs=(qspec, kspec, kspec, P(qspec[0], None), P(qspec[2])),
        out_specs=qspec,
        check_vma=False,
    )
    return fn(q, k, v, segment_ids, sinks)


def _splash_local(q, k, v, q_seg, sinks, window):
    # lazy: optional dependency (Pallas TPU)
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as sm,
    )

    b, s, n, h = q.shape
    kh = k.shape[2]
    mask = sm.CausalMask((s, s))
    if window is not None:  # the last `window` keys, the query's own included
        mask = sm.LocalMask((s, s), window_size=(window - 1, 0), offset=0)
    kernel = sk.make_splash_mha(sm.MultiHeadMask([mask] * n), head_shards=1, q_seq_shards=1)
    scale = 1.0 / math.sqrt(h)

    def one(qb, kb, vb, segb):
        # [heads, s, h] per batch row; GQA: each KV head serves n // kh query heads.
        kb = jnp.repeat(kb, n // kh, axis=0)
        vb = jnp.repeat(vb, n // kh, axis=0)
        return kernel(qb * scale, kb, vb, segment_ids=sk.SegmentIds(q=segb, kv=segb), sinks=sinks)

    out = jax.vmap(one)(
        q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), q_seg
    )
    return out.transpose(0, 2, 1, 3).astype(q.dtype)
