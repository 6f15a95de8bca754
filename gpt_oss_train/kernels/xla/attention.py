"""Attention with per-head sinks: the XLA reference and the blockwise variant.

GPT-OSS attention: grouped-query (num_heads query heads share num_kv_heads key/value
heads), scale 1/sqrt(head_dim), and one learned "sink" logit per query head that joins
the softmax denominator only (no value, no scale):

    out_i = sum_j e^{s_ij} v_j / (sum_j e^{s_ij} + e^{sink})

Which keys a query sees is decided by positions and segment ids, never by array indices,
so the same code serves packed training sequences, left/right-padded batches and a KV
cache whose slots hold arbitrary positions (a key slot with position < 0 is empty):

    key j visible to query i  <=>  0 <= pos_j <= pos_i  and  seg_j == seg_i
                                   and (banded layers) pos_i - pos_j < window

  self_attention            the `attention` op's reference: full [q, k] logits in float32
  blockwise_self_attention  query blocks under lax.map; banded layers only read the keys
                            their window can reach: O(block * (block + window)) memory
  cache_attention           the `cache_attention` op's reference: a step's queries over
                            one layer of the stacked KV cache
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite "minus infinity": keeps max/exp/grad free of inf - inf


def visibility_mask(q_pos, k_pos, q_seg=None, k_seg=None, window: int | None = None):
    """[b, s, t] bool: which keys each query may attend to (see module docstring)."""
    qp = q_pos[:, :, None]
    kp = k_pos[:, None, :]
    mask = (kp >= 0) & (kp <= qp)
    if window is not None:
        mask &= (qp - kp) < window
    if q_seg is not None:
        mask &= q_seg[:, :, None] == k_seg[:, None, :]
    return mask


def xla_attention(q, k, v, sinks, mask):
    """q [b,s,n,h], k/v [b,t,k,h], sinks [n], mask [b,s,t] -> [b,s,n,h] in q.dtype."""
    b, s, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    qg = q.reshape(b, s, kh, g, h)
    logits = jnp.einsum("bskgh,btkh->bkgst", qg, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(h))
    logits = jnp.where(mask[:, None, None], logits, _NEG)
    sink = sinks.astype(jnp.float32).reshape(1, kh, g, 1, 1)
    # The sink is finite, so the row max is finite even when every key is masked: such a
    # row (a padding query) gets weights 0 and output 0, not NaN.
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - m)
    p = p / denom
    out = jnp.einsum("bkgst,btkh->bskgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, n, h).astype(q.dtype)


def blockwise_attention(q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, window, block):
    """Self-attention in query blocks. Requires q and k to be the same sequence (s == t),
    with positions consecutive within a segment, so a banded query at index i can only see
    keys at indices (i - window, i]."""
    b, s, n, h = q.shape
    if s <= block:
        return xla_attention(q, k, v, sinks, visibility_mask(q_pos, k_pos, q_seg, k_seg, window))
    pad = (-s) % block
    if pad:  # padded queries/keys get position -1: invisible, and their outputs are dropped
        padq = lambda a, val: jnp.pad(
            a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=val
        )
        q, k, v = padq(q, 0), padq(k, 0), padq(v, 0)
        q_pos, k_pos = padq(q_pos, -1), padq(k_pos, -1)
        q_seg, k_seg = padq(q_seg, 0), padq(k_seg, 0)
    nblocks = q.shape[1] // block
    if window is not None and window < q.shape[1]:
        # Keys for block i: indices [i*block - lead, (i+1)*block), lead = window-1 rounded up.
        lead = -(-(window - 1) // 8) * 8
        padk = lambda a, val: jnp.pad(
            a, [(0, 0), (lead, 0)] + [(0, 0)] * (a.ndim - 2), constant_values=val
        )
        kk, vv, kp, ks = padk(k, 0), padk(v, 0), padk(k_pos, -1), padk(k_seg, 0)
        span = lead + block

        def one_block(i):
            start = i * block
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, start, block, axis=1)
            kl = lambda a: jax.lax.dynamic_slice_in_dim(a, start, span, axis=1)
            mask = visibility_mask(sl(q_pos), kl(kp), sl(q_seg), kl(ks), window)
            return xla_attention(sl(q), kl(kk), kl(vv), sinks, mask)
    else:

        def one_block(i):
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * block, block, axis=1)
            mask = visibility_mask(sl(q_pos), k_pos, sl(q_seg), k_seg, window)
            return xla_attention(sl(q), k, v, sinks, mask)

    # Checkpoint each block so the backward pass keeps no [block, keys] probabilities.
    outs = jax.lax.map(jax.checkpoint(one_block), jnp.arange(nblocks))  # [nb, b, blk, n, h]
    out = jnp.moveaxis(outs, 0, 1).reshape(b, nblocks * block, n, h)
    return out[:, :s]


def self_attention(q, k, v, sinks, *, positions, segment_ids, window, block):
    """q [b, s, n, h] and k/v [b, s, kh, h] of the same sequences -> [b, s, n, h]."""
    mask = visibility_mask(positions, positions, segment_ids, segment_ids, window)
    return xla_attention(q, k, v, sinks, mask)


def blockwise_self_attention(q, k, v, sinks, *, positions, segment_ids, window, block):
    """`self_attention` in query blocks of `block` rows."""
    pos, seg = positions, segment_ids
    return blockwise_attention(q, k, v, sinks, pos, pos, seg, seg, window, block)


def cache_attention(q, cache, layer, sinks, *, positions, window):
    """q [b, s, n, h] at `positions` over layer `layer` of the stacked cache (its keys
    already written) -> [b, s, n, h] in q's dtype."""
    mine = jax.tree.map(lambda a: a[layer], cache)
    keys, values = mine.keys_values(q.dtype)
    return xla_attention(
        q, keys, values, sinks, visibility_mask(positions, mine.pos, window=window)
    )
