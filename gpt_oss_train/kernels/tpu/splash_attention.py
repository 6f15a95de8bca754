"""TPU splash attention (JAX's Pallas kernel), which takes the sinks itself, forward and
gradient: the `attention` op's `splash` implementation.

Causal by index within the sequence plus segment ids: valid for training and prefill of
whole sequences, where positions equal indices within each segment. A Mosaic kernel
cannot be partitioned by XLA, so under a mesh it runs in `shard_map` over the batch and
head axes of the logical rules (each device: its rows, its heads, the whole sequence);
rules that shard head_dim, or query and KV heads differently, and sequences that are not
whole 128-position blocks, leave the XLA reference in its place (`accepts`).

A sequence the rules split (context parallelism) comes to `context_parallel` instead
(the kernels' dispatch, kernels/__init__.py): kernels/xla/context_parallel.py moves the
keys between the shards, and each shard runs splash on its own queries, whole blocks of
them (else the XLA blockwise attention runs there):

  full layers    over the gathered sequence: one kernel for the whole (S, S) causal mask
                 made for `q_seq_shards` = the shards, whose block tables (the mask info)
                 enter the shard_map split along the query sequence
                 (`manual_sharding_spec`), so each shard reads its own rows' tables and
                 its queries' global indices.
  banded layers  over the previous shard's tail and its own keys: a LocalMask whose
                 offset puts query i at key i + lead (the tail's length).

Splash skips the blocks the causal order hides, so a full layer's first shard has fewer
blocks to compute than its last, which the others wait for; a zig-zag order of the pieces
would even them out.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
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
# A split full layer's kernel covers the whole sequence's causal mask, whose block tables
# splash builds in Python, one block at a time: 72 s for 131,072 positions in blocks of
# 512 on a 2-core Xeon. So that layer takes the largest of these blocks its shards divide
# into, and sequences whose grid would exceed MAX_FULL_GRID blocks (past 262,144
# positions) keep the XLA blockwise attention.
FULL_BLOCKS = (512, 256, BLOCK)
MAX_FULL_GRID = 512 * 512


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
    s = q.shape[1]
    _, sm = _lib()
    mask = sm.CausalMask((s, s))
    if window is not None:  # the last `window` keys, the query's own included
        mask = sm.LocalMask((s, s), window_size=(window - 1, 0), offset=0)
    return _run(_kernel(mask, q.shape[2] // k.shape[2]), q, k, v, q_seg, q_seg, sinks)


def context_parallel(split):
    """The per-shard kernel of a sequence split over `split.axes` (context_parallel.Split):
    (run, extra operands with their shard_map specs), or None where the shard's queries are
    not whole blocks or a full layer's grid is too large (MAX_FULL_GRID): the XLA
    blockwise attention then runs."""
    if split.shard_len % BLOCK:
        return None
    _, sm = _lib()
    if split.window is None:
        block = next(b for b in FULL_BLOCKS if split.shard_len % b == 0)
        if (split.seq_len // block) ** 2 > MAX_FULL_GRID:
            return None
        whole = (split.seq_len, split.seq_len)
        kernel = _kernel(sm.CausalMask(whole), split.group, split.seq_len // split.shard_len, block)
        rows = NamedSharding(split.mesh, P(None, sharding.spec_entry(split.axes)))
        return _full, ((kernel, kernel.manual_sharding_spec(rows)),)
    # Keys in whole blocks: padding (segment 0) in front of the tail where it is short.
    front = -(split.lead + split.shard_len) % BLOCK
    keys = front + split.lead + split.shard_len
    band = sm.LocalMask(
        (split.shard_len, keys), window_size=(split.window - 1, 0), offset=front + split.lead
    )
    return functools.partial(_banded, _kernel(band, split.group), front), ()


def _full(q, k, v, sinks, q_pos, k_pos, q_seg, k_seg, kernel):
    """This shard's queries over the gathered sequence; `kernel` holds its rows' tables."""
    return _run(kernel, q, k, v, q_seg, k_seg, sinks)


def _banded(kernel, front, q, k, v, sinks, q_pos, k_pos, q_seg, k_seg):
    """This shard's queries over the previous shard's tail and its own keys."""
    pad = lambda a: jnp.pad(a, [(0, 0), (front, 0)] + [(0, 0)] * (a.ndim - 2))
    return _run(kernel, q, pad(k), pad(v), q_seg, pad(k_seg), sinks)


def _lib():
    """splash's kernel and mask modules."""
    # lazy: optional dependency (Pallas TPU)
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel,
        splash_attention_mask,
    )

    return splash_attention_kernel, splash_attention_mask


def _kernel(mask, group, q_seq_shards=1, block=None):
    """The kernel for `mask` on the `group` query heads of one KV head (splash's MQA form,
    which `_run` maps over the KV heads), in blocks of `block` (None: splash's default,
    128). Off a TPU (tests on a CPU) it runs in Pallas' interpreter."""
    return _make_kernel(mask, group, q_seq_shards, block, sharding.platform() != "tpu")


@functools.lru_cache(maxsize=64)
def _make_kernel(mask, group, q_seq_shards, block, interpret):
    # Cached: the block tables are built in Python, a loop over every block of the mask.
    sk, sm = _lib()
    sizes = None if block is None else sk.BlockSizes(*(block,) * 8)
    make = functools.partial(
        sk.make_splash_mqa,
        sm.MultiHeadMask([mask] * group),
        head_shards=1,
        q_seq_shards=q_seq_shards,
        block_sizes=sizes,
        interpret=interpret,
    )
    # Made in a thread of its own, which inherits neither the trace that first asks (a
    # cached kernel must not hold one trace's values) nor its mesh (whose devices may be
    # a TPU slice's compile-only descriptions), and kept as numpy: constants of any program.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return jax.tree.map(np.asarray, pool.submit(make).result())


def _run(kernel, q, k, v, q_seg, k_seg, sinks):
    """q [b, s, n, h] over k/v [b, t, kh, h] with segment ids [b, s] / [b, t] -> [b, s, n, h]."""
    sk, _ = _lib()
    (_, s, n, h), kh = q.shape, k.shape[2]
    scale = 1.0 / math.sqrt(h)
    # GQA as splash's MQA kernel mapped over the KV heads: query head j reads KV head
    # j // group, and no KV head is copied per query head (8x the gathered keys of a split
    # full layer at gpt-oss's 64 / 8 heads).
    groups = lambda a: a.reshape(kh, n // kh, *a.shape[1:])
    sinks = groups(sinks.astype(jnp.float32))

    def one(qb, kb, vb, q_segb, k_segb):  # qb [n, s, h], kb/vb [kh, t, h]
        seg = sk.SegmentIds(q=q_segb, kv=k_segb)
        per_kv = lambda qg, kg, vg, sg: kernel(qg, kg, vg, segment_ids=seg, sinks=sg)
        return jax.vmap(per_kv)(groups(qb * scale), kb, vb, sinks).reshape(n, s, h)

    heads_first = lambda a: a.transpose(0, 2, 1, 3)
    out = jax.vmap(one)(heads_first(q), heads_first(k), heads_first(v), q_seg, k_seg)
    return heads_first(out).astype(q.dtype)
