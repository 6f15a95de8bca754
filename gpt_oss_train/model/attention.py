"""Attention with per-head sinks, behind one function with several back-ends.

GPT-OSS attention: grouped-query (num_heads query heads share num_kv_heads key/value
heads), scale 1/sqrt(head_dim), and one learned "sink" logit per query head that joins
the softmax denominator only (no value, no scale):

    out_i = sum_j e^{s_ij} v_j / (sum_j e^{s_ij} + e^{sink})

Which keys a query sees is decided by positions and segment ids, never by array indices,
so the same code serves packed training sequences, left/right-padded batches and a KV
cache whose slots hold arbitrary positions (a key slot with position < 0 is empty):

    key j visible to query i  <=>  0 <= pos_j <= pos_i  and  seg_j == seg_i
                                   and (banded layers) pos_i - pos_j < window

Back-ends:
  xla        the reference: full [q, k] logits in float32. Any shapes (decode too).
  blockwise  query blocks under lax.map; banded layers only read the keys their window
             can reach, so memory is O(block * (block + window)) instead of O(S^2).
             Self-attention over a sequence (training, prefill).
  splash     TPU Pallas splash attention, which takes the sinks itself; under shard_map
             over batch and heads.
  flash      GPU Pallas (Triton) flash attention with sinks, window and segments, forward
             and backward (flash_attention.py); under shard_map over batch and heads.

On a CPU with AVX-512 and one device, `xla` and `blockwise` self-attention (training,
prefill) run as a C++ kernel instead (cpu_kernels/self_attention.py): the same
visibility, sinks and results, blocks of queries against blocks of keys with an online
softmax, forward and backward, never materializing the [q, k] logits.

Decode on a CPU does not come here: its few queries attend over the stacked float32 cache
in a C++ custom call that reads it in place (cpu_kernels/decode_attention.py), with the
same visibility and results as `xla_attention`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gpt_oss_train import sharding
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.model.cpu_kernels import self_attention as cpu_self_attention

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


def splash_attention(q, k, v, sinks, q_seg, window):
    """TPU splash attention (Pallas), which takes the sinks itself (forward and gradient).

    Causal by index within the sequence plus segment ids: valid for training and prefill
    of whole sequences, where positions equal indices within each segment. A Mosaic
    kernel cannot be partitioned by XLA, so under a mesh it runs in `shard_map` over the
    batch and head axes of the logical rules (each device: its rows, its heads, the whole
    sequence).
    """
    ctx = sharding.active()
    if ctx is None:
        return _splash_local(q, k, v, q_seg, sinks.astype(jnp.float32), window)
    mesh, rules = ctx
    qspec = sharding.fit_spec(
        sharding.logical_to_spec(("batch", "length", "heads", "head_dim"), rules), q.shape, mesh
    )
    kspec = sharding.fit_spec(
        sharding.logical_to_spec(("batch", "length", "kv_heads", "head_dim"), rules), k.shape, mesh
    )
    if qspec[1] is not None or qspec[3] is not None or kspec[2] != qspec[2]:
        raise ValueError(
            "config.attention_impl='splash' needs the sequence and head_dim unsharded and query "
            f"and KV heads sharded alike; the rules give q {qspec}, k {kspec}. Use 'blockwise'."
        )
    fn = jax.shard_map(
        lambda q, k, v, seg, snk: _splash_local(q, k, v, seg, snk, window),
        mesh=mesh,
        in_specs=(qspec, kspec, kspec, P(qspec[0], None), P(qspec[2])),
        out_specs=qspec,
        check_vma=False,
    )
    return fn(q, k, v, q_seg, sinks.astype(jnp.float32))


def _splash_local(q, k, v, q_seg, sinks, window):
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


def _xla(q, k, v, sinks, *, q_pos, k_pos, q_seg, k_seg, window, block):
    return xla_attention(q, k, v, sinks, visibility_mask(q_pos, k_pos, q_seg, k_seg, window))


def _blockwise(q, k, v, sinks, *, q_pos, k_pos, q_seg, k_seg, window, block):
    return blockwise_attention(q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, window, block)


def _splash(q, k, v, sinks, *, q_pos, k_pos, q_seg, k_seg, window, block):
    if sharding.platform() != "tpu":
        raise ConfigError("config.attention_impl='splash' needs a TPU; use 'blockwise' or 'xla'")
    return splash_attention(q, k, v, sinks, q_seg, window)


def _flash(q, k, v, sinks, *, q_pos, k_pos, q_seg, k_seg, window, block):
    # Imported here: the Pallas GPU modules load only for a config that asks for them.
    from gpt_oss_train.model import flash_attention as flash

    if sharding.platform() != "gpu" and not flash.interpreting():
        raise ConfigError("config.attention_impl='flash' needs a GPU; use 'blockwise' or 'xla'")
    return flash.flash_attention_on_mesh(q, k, v, sinks, q_pos, q_seg, window)


# The back-ends by `config.attention_impl`. Each takes q/k/v, the sinks, positions and
# segment ids of queries and keys, the band (None: full causal) and the query block.
IMPLS = {"xla": _xla, "blockwise": _blockwise, "splash": _splash, "flash": _flash}


def attention(
    q,
    k,
    v,
    sinks,
    *,
    q_pos,
    k_pos,
    q_seg=None,
    k_seg=None,
    window: int | None = None,
    impl: str = "xla",
    block: int = 512,
    self_attention: bool = False,
):
    """Runs back-end `impl`. `self_attention`: q and k are the same full sequence
    (training, or a prefill with no earlier cache); the block-sparse back-ends need that,
    so attention over a cache always takes the XLA reference."""
    if not self_attention:
        impl = "xla"
    elif q_seg is None:
        q_seg = k_seg = (q_pos >= 0).astype(jnp.int32)
    if self_attention and impl in ("xla", "blockwise") and cpu_self_attention.applies(q, k):
        return cpu_self_attention.self_attention(q, k, v, sinks, q_pos, q_seg, window)
    where = dict(q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg)
    return IMPLS[impl](q, k, v, sinks, **where, window=window, block=block)
