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


def streamed_attention(q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, window, key_block):
    """`xla_attention` with the keys taken `key_block` at a time (lax.scan, an online
    softmax: running max, denominator and weighted sum), so no [queries, all keys] logits
    exist at once, forward or backward (each step is recomputed, only the running sums are
    kept). The sink starts the running sums: max = sink, denominator = e^0 = 1, sum = 0."""
    b, s, n, h = q.shape
    t, kh = k.shape[1], k.shape[2]
    g = n // kh
    pad = (-t) % key_block  # none where the caller padded the keys once for every block
    k, v, k_pos, k_seg = (
        _pad_length(a, 0, pad, fill) for a, fill in ((k, 0), (v, 0), (k_pos, -1), (k_seg, 0))
    )
    qg = q.reshape(b, s, kh, g, h)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kh, g, 1), (b, kh, g, s))

    def step(carry, start):
        m, denom, acc = carry
        kb = jax.lax.dynamic_slice_in_dim(k, start, key_block, axis=1)
        vb = jax.lax.dynamic_slice_in_dim(v, start, key_block, axis=1)
        kp, ks = (jax.lax.dynamic_slice_in_dim(a, start, key_block, axis=1) for a in (k_pos, k_seg))
        logits = jnp.einsum("bskgh,btkh->bkgst", qg, kb, preferred_element_type=jnp.float32)
        logits = logits * (1.0 / math.sqrt(h))
        mask = visibility_mask(q_pos, kp, q_seg, ks, window)
        logits = jnp.where(mask[:, None, None], logits, _NEG)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        p = jnp.exp(logits - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        denom = denom * rescale + jnp.sum(p, axis=-1)
        pv = jnp.einsum(
            "bkgst,btkh->bkgsh", p.astype(v.dtype), vb, preferred_element_type=jnp.float32
        )
        return (m_new, denom, acc * rescale[..., None] + pv), None

    init = (sink, jnp.ones_like(sink), jnp.zeros((b, kh, g, s, h), jnp.float32))
    starts = jnp.arange(0, t + pad, key_block)
    (_, denom, acc), _ = jax.lax.scan(jax.checkpoint(step), init, starts)
    out = acc / denom[..., None]  # [b, kh, g, s, h]
    return jnp.moveaxis(out, 3, 1).reshape(b, s, n, h).astype(q.dtype)


def lead_keys(window: int) -> int:
    """How many keys before a query block a banded layer reads: window-1, rounded up to 8
    (also what a context shard takes from the previous one)."""
    return -(-(window - 1) // 8) * 8


def blockwise_attention(
    q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, window, block, lead=0, key_block=None
):
    """Attention in query blocks of `block` rows (lax.map, each block checkpointed, so the
    backward pass keeps no [block, keys] probabilities).

    Banded layers (window shorter than the queries) read only the keys their window can
    reach: k/v then hold the queries' own keys, preceded by `lead` keys from before the
    first query (context parallelism: the previous shard's tail), with positions
    consecutive within a segment, so a query at index i sees keys at indices
    (i - window, i] only. Otherwise every query block reads every key, and k/v may be any
    keys (a context shard's queries over the gathered sequence); with `key_block`, more
    keys than that are streamed (`streamed_attention`), so memory stays
    O(block * key_block) however long the sequence."""
    b, s, n, h = q.shape
    if s <= block and (key_block is None or k.shape[1] <= key_block):
        return xla_attention(q, k, v, sinks, visibility_mask(q_pos, k_pos, q_seg, k_seg, window))
    block = min(block, s)
    pad = (-s) % block
    # Padded queries get position -1 (they see no key) and their outputs are dropped.
    q, q_pos, q_seg = (
        _pad_length(a, 0, pad, fill) for a, fill in ((q, 0), (q_pos, -1), (q_seg, 0))
    )
    nblocks = q.shape[1] // block
    if window is not None and window < s:
        # Keys for block i: indices [i*block - span_lead, (i+1)*block) of the queries'
        # own, span_lead = window-1 rounded up; missing ones are padding (position -1).
        span_lead = lead_keys(window)
        front, back = span_lead - lead, nblocks * block - s
        k, v, k_pos, k_seg = (
            _pad_length(a, front, back, fill)
            for a, fill in ((k, 0), (v, 0), (k_pos, -1), (k_seg, 0))
        )
        span = span_lead + block

        def keys_of(i):
            kl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * block, span, axis=1)
            return kl(k), kl(v), kl(k_pos), kl(k_seg)
    else:
        if key_block is not None and k.shape[1] > key_block:
            # Padded once here for every query block's streamed pass.
            back = (-k.shape[1]) % key_block
            k, v, k_pos, k_seg = (
                _pad_length(a, 0, back, fill)
                for a, fill in ((k, 0), (v, 0), (k_pos, -1), (k_seg, 0))
            )

        def keys_of(i):
            return k, v, k_pos, k_seg

    def one_block(i):
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * block, block, axis=1)
        kk, vv, kp, ks = keys_of(i)
        if key_block is not None and kk.shape[1] > key_block:
            return streamed_attention(
                sl(q), kk, vv, sinks, sl(q_pos), kp, sl(q_seg), ks, window, key_block
            )
        return xla_attention(
            sl(q), kk, vv, sinks, visibility_mask(sl(q_pos), kp, sl(q_seg), ks, window)
        )

    outs = jax.lax.map(jax.checkpoint(one_block), jnp.arange(nblocks))  # [nb, b, blk, n, h]
    out = jnp.moveaxis(outs, 0, 1).reshape(b, nblocks * block, n, h)
    return out[:, :s]


def _pad_length(a, before: int, after: int, value):
    """`a` [b, s, ...] with `before` entries of `value` put in front of its length axis
    and `after` behind it (a negative `before` drops that many from the front)."""
    if before < 0:
        a, before = a[:, -before:], 0
    if not (before or after):
        return a
    return jnp.pad(a, [(0, 0), (before, after)] + [(0, 0)] * (a.ndim - 2), constant_values=value)


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
