"""Flash attention with GPT-OSS semantics, as Pallas kernels for GPUs (Triton lowering).

Same result as `xla/attention.xla_attention` with its `visibility_mask` over one
sequence (self-attention: training and whole-sequence prefill): grouped-query heads,
scale 1/sqrt(head_dim), one learned sink logit per query head in the softmax denominator
only, causal by position, the banded layers' window (0 <= q_pos - k_pos < window) and
segment ids. A query that sees no key gets 0 (its only softmax term is the sink).

What the kernels do that XLA does not: they never write the [queries, keys] scores to
memory (an online softmax keeps, per query row, the running max m, the running sum l and
the unnormalized output), and they skip key blocks that causality or the window rule
out, so a banded layer costs O(S * window), not O(S^2). The skipping assumes what
`xla/attention.blockwise_attention` assumes: positions are consecutive within a segment, so
the key at index j is only visible to queries at indices [j, j + window). The mask inside
a visited block is computed from positions and segment ids, exactly as in the reference.

The sink enters the online softmax as its starting point: m = sink, l = e^(sink - m) = 1,
output 0. It is finite, so the running max never is -inf and a fully masked row ends as
0 / 1 = 0 instead of NaN.

Backward (custom VJP). With p_ij = e^(s_ij - lse_i), where lse_i includes the sink,
D_i = dO_i . O_i and p_sink_i = e^(sink - lse_i):
    dV_j = sum_i p_ij dO_i        dS_ij = p_ij (dO_i . V_j - D_i)
    dQ_i = scale sum_j dS_ij K_j  dK_j = scale sum_i dS_ij Q_i
    d sink = -sum_i p_sink_i D_i   (the sink has no value: dO_i . dO_i/d sink = -p_sink_i D_i)
The forward saves lse, so both backward kernels recompute p tile by tile. The dK/dV kernel
runs per KV head and loops over the query heads of its group, so GQA needs no reduction
afterwards.

Only generic Pallas is used (BlockSpecs, refs, `pl.ds`, `lax.fori_loop`, `jnp`), so
`interpret=True` runs the very same kernels on a CPU: that is how the tests check them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from gpt_oss_train import sharding
from gpt_oss_train.kernels.gpu.interpret import interpreting, unavailable  # noqa: F401

_MASKED = -1e30  # finite "minus infinity", as in xla/attention.py: exp() of it is 0, never NaN
_MIN_BLOCK = 16  # Triton's smallest matmul tile side


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes (powers of two >= 16). Untuned defaults: 64 x 64 tiles keep a head_dim-64
    bf16 kernel's working set small on Hopper; to be tuned on a GPU."""

    q: int = 64  # forward: query rows per program
    k: int = 64  # forward: keys per inner step
    bwd_q: int = 64  # backward: query rows per step (dK/dV) or program (dQ)
    bwd_k: int = 64  # backward: keys per program (dK/dV) or step (dQ)
    num_warps: int = 4
    num_stages: int = 2


_TILE_FIELDS = ("q", "k", "bwd_q", "bwd_k")


@dataclasses.dataclass(frozen=True)
class _Static:
    window: int | None
    blocks: Blocks
    seq: int  # padded sequence length
    scale: float  # 1/sqrt(head_dim) of the unpadded head_dim
    interpret: bool


# ----------------------------------------------------------------------------- shared tiles


def _scores(q, k, q_pos, k_pos, q_seg, k_seg, st: _Static):
    """Scaled logits of a [bq, h] x [bk, h] tile in float32, masked to _MASKED where the
    key is invisible (empty slot, future, other segment, outside the window)."""
    s = _dot(q, k, ((1,), (1,))) * st.scale
    qp, kp = q_pos[:, None], k_pos[None, :]
    visible = (kp >= 0) & (kp <= qp) & (q_seg[:, None] == k_seg[None, :])
    if st.window is not None:
        visible &= (qp - kp) < st.window
    return jnp.where(visible, s, _MASKED)


def _key_blocks(q_start, rows: int, block_k: int, st: _Static):
    """[lo, hi): the key blocks that can hold keys visible to query indices
    [q_start, q_start + rows); every other block is skipped."""
    hi = jnp.minimum(lax.div(q_start + rows - 1, block_k) + 1, st.seq // block_k)
    if st.window is None:
        return 0, hi
    return lax.div(jnp.maximum(q_start - st.window + 1, 0), block_k), hi


def _query_blocks(k_start, cols: int, block_q: int, st: _Static):
    """[lo, hi): the query blocks that can see a key of indices [k_start, k_start + cols)."""
    lo = lax.div(k_start, block_q)
    if st.window is None:
        return lo, st.seq // block_q
    last = k_start + cols - 1 + st.window - 1  # the last query the band lets see a key
    return lo, jnp.minimum(lax.div(last, block_q) + 1, st.seq // block_q)


def _dot(a, b, contract=((1,), (0,))):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _params(blocks: Blocks):
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


# ----------------------------------------------------------------------------- forward


def _forward_kernel(
    sinks_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, o_ref, lse_ref, *, st
):
    """One (batch row, query head, query block): online softmax over the visible key blocks."""
    bq, bk = st.blocks.q, st.blocks.k
    q, q_pos, q_seg = q_ref[...], qpos_ref[...], qseg_ref[...]
    sink = sinks_ref[pl.program_id(1)]

    def step(j, carry):
        m, l, acc = carry
        keys = pl.ds(j * bk, bk)
        s = _scores(q, k_ref[keys, :], q_pos, kpos_ref[keys], q_seg, kseg_ref[keys], st)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        rescale = jnp.exp(m - m_new)  # earlier terms were summed relative to the old max
        p = jnp.exp(s - m_new[:, None])
        v = v_ref[keys, :]
        acc = acc * rescale[:, None] + _dot(p.astype(v.dtype), v)
        return m_new, l * rescale + jnp.sum(p, axis=1), acc

    # The sink starts the softmax: m = sink, l = e^0 = 1, no output.
    m = jnp.full((bq,), sink, jnp.float32)
    init = (m, jnp.ones((bq,), jnp.float32), jnp.zeros(q.shape, jnp.float32))
    lo, hi = _key_blocks(pl.program_id(2) * bq, bq, bk, st)
    m, l, acc = lax.fori_loop(lo, hi, step, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _forward(q, k, v, sinks, pos, seg, st: _Static):
    b, s, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    bq = st.blocks.q
    row = lambda size: pl.BlockSpec((None, size), lambda bi, hd, i: (bi, i))
    whole = lambda size: pl.BlockSpec((None, size), lambda bi, hd, i: (bi, 0))
    kv_spec = pl.BlockSpec((None, s, None, h), lambda bi, hd, i: (bi, 0, hd // g, 0))
    q_spec = pl.BlockSpec((None, bq, None, h), lambda bi, hd, i: (bi, i, hd, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, st=st),
        grid=(b, n, s // bq),
        in_specs=[
            pl.BlockSpec((n,), lambda bi, hd, i: (0,)),
            q_spec,
            kv_spec,
            kv_spec,
            row(bq),
            whole(s),
            row(bq),
            whole(s),
        ],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda bi, hd, i: (bi, hd, i))],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, n, s), jnp.float32),
        ],
        compiler_params=_params(st.blocks),
        interpret=st.interpret,
        name="gpt_oss_flash_forward",
    )(sinks, q, k, v, pos, pos, seg, seg)


# ----------------------------------------------------------------------------- backward


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qpos_ref,
    kpos_ref,
    qseg_ref,
    kseg_ref,
    dq_ref,
    *,
    st,
):
    """One (batch row, query head, query block): dQ over the visible key blocks."""
    bq, bk = st.blocks.bwd_q, st.blocks.bwd_k
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos, q_seg = qpos_ref[...], qseg_ref[...]

    def step(j, dq):
        keys = pl.ds(j * bk, bk)
        k, v = k_ref[keys, :], v_ref[keys, :]
        s = _scores(q, k, q_pos, kpos_ref[keys], q_seg, kseg_ref[keys], st)
        p = jnp.exp(s - lse[:, None])
        ds = p * (_dot(do, v, ((1,), (1,))) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    lo, hi = _key_blocks(pl.program_id(2) * bq, bq, bk, st)
    dq = lax.fori_loop(lo, hi, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qpos_ref,
    kpos_ref,
    qseg_ref,
    kseg_ref,
    dk_ref,
    dv_ref,
    *,
    st,
    group: int,
):
    """One (batch row, KV head, key block): dK and dV summed over the query heads that
    share this KV head and the query blocks that can see these keys."""
    bq, bk = st.blocks.bwd_q, st.blocks.bwd_k
    k, v = k_ref[...], v_ref[...]
    k_pos, k_seg = kpos_ref[...], kseg_ref[...]
    lo, hi = _query_blocks(pl.program_id(2) * bk, bk, bq, st)

    def head(hd, carry):
        def step(i, carry):
            dk, dv = carry
            rows = pl.ds(i * bq, bq)
            q, do = q_ref[rows, hd, :], do_ref[rows, hd, :]
            s = _scores(q, k, qpos_ref[rows], k_pos, qseg_ref[rows], k_seg, st)
            p = jnp.exp(s - lse_ref[hd, rows][:, None])
            dv = dv + _dot(p.astype(do.dtype), do, ((0,), (0,)))
            ds = p * (_dot(do, v, ((1,), (1,))) - delta_ref[hd, rows][:, None])
            return dk + _dot(ds.astype(q.dtype), q, ((0,), (0,))), dv

        return lax.fori_loop(lo, hi, step, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(q, k, v, do, lse, delta, pos, seg, st: _Static):
    b, s, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    bq, bk = st.blocks.bwd_q, st.blocks.bwd_k
    common = dict(compiler_params=_params(st.blocks), interpret=st.interpret)
    operands = (q, k, v, do, lse, delta, pos, pos, seg, seg)

    # dQ: grid over (batch, query head, query block).
    q_spec = pl.BlockSpec((None, bq, None, h), lambda bi, hd, i: (bi, i, hd, 0))
    kv_spec = pl.BlockSpec((None, s, None, h), lambda bi, hd, i: (bi, 0, hd // g, 0))
    stat = pl.BlockSpec((None, None, bq), lambda bi, hd, i: (bi, hd, i))
    rows = pl.BlockSpec((None, bq), lambda bi, hd, i: (bi, i))
    whole = pl.BlockSpec((None, s), lambda bi, hd, i: (bi, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st),
        grid=(b, n, s // bq),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, stat, stat, rows, whole, rows, whole],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="gpt_oss_flash_dq",
        **common,
    )(*operands)

    # dK, dV: grid over (batch, KV head, key block); the group's query heads come whole.
    group_spec = pl.BlockSpec((None, s, g, h), lambda bi, kv, j: (bi, 0, kv, 0))
    k_spec = pl.BlockSpec((None, bk, None, h), lambda bi, kv, j: (bi, j, kv, 0))
    group_stat = pl.BlockSpec((None, g, s), lambda bi, kv, j: (bi, kv, 0))
    whole = pl.BlockSpec((None, s), lambda bi, kv, j: (bi, 0))
    cols = pl.BlockSpec((None, bk), lambda bi, kv, j: (bi, j))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, st=st, group=g),
        grid=(b, kh, s // bk),
        in_specs=[group_spec, k_spec, k_spec, group_spec, group_stat, group_stat]
        + [whole, cols, whole, cols],  # q, k, v, dO, lse, D; q/k positions, q/k segments
        out_specs=[k_spec, k_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="gpt_oss_flash_dkv",
        **common,
    )(*operands)
    return dq, dk, dv


# ----------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, sinks, pos, seg, st: _Static):
    return _forward(q, k, v, sinks.astype(jnp.float32), pos, seg, st)[0]


def _flash_fwd(q, k, v, sinks, pos, seg, st):
    out, lse = _forward(q, k, v, sinks.astype(jnp.float32), pos, seg, st)
    return out, (q, k, v, sinks, pos, seg, out, lse)


def _flash_bwd(st, res, do):
    q, k, v, sinks, pos, seg, out, lse = res
    do = do.astype(q.dtype)
    # D_i = dO_i . O_i, per (batch, head, query) like lse; XLA fuses this elementwise pass.
    delta = jnp.einsum("bsnh,bsnh->bns", out.astype(jnp.float32), do.astype(jnp.float32))
    dq, dk, dv = _backward(q, k, v, do, lse, delta, pos, seg, st)
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
    dsinks = -jnp.sum(p_sink * delta, axis=(0, 2))
    return dq, dk, dv, dsinks.astype(sinks.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- entry point


def _pad_axis(a, axis: int, size: int, value=0):
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths, constant_values=value) if size > a.shape[axis] else a


def _fit(blocks: Blocks, seq: int) -> Blocks:
    """Shrink tiles that exceed a short sequence (keeping powers of two >= 16)."""
    cap = max(_MIN_BLOCK, pl.next_power_of_2(seq))
    return dataclasses.replace(blocks, **{f: min(getattr(blocks, f), cap) for f in _TILE_FIELDS})


def flash_attention(
    q,
    k,
    v,
    sinks,
    positions,
    segment_ids,
    window: int | None = None,
    *,
    blocks: Blocks = Blocks(),
    interpret: bool | None = None,
):
    """Self-attention over one sequence: q [b,s,n,h], k/v [b,s,k,h], sinks [n], positions and
    segment_ids [b,s] int (a position < 0 is an empty slot). Returns [b,s,n,h] in q.dtype.
    `interpret`: None = the `interpret.interpret_mode()` context's choice."""
    b, s, n, h = q.shape
    if k.shape[:2] != (b, s) or v.shape != k.shape or n % k.shape[2]:
        raise ValueError(f"flash_attention: q {q.shape}, k {k.shape}, v {v.shape} do not match")
    for f in _TILE_FIELDS:
        size = getattr(blocks, f)
        if size < _MIN_BLOCK or size & (size - 1):
            raise ValueError(f"flash_attention: Blocks.{f}={size} must be a power of two >= 16")
    blocks = _fit(blocks, s)
    tile = max(blocks.q, blocks.k, blocks.bwd_q, blocks.bwd_k)  # powers of two: a multiple of all
    seq = -(-s // tile) * tile
    # Triton tiles are powers of two: zero head_dim columns change no dot product; padded
    # sequence slots get position -1, so no query sees them, and their outputs are dropped.
    hp = max(_MIN_BLOCK, pl.next_power_of_2(h))
    q, k, v = (_pad_axis(_pad_axis(a, 3, hp), 1, seq) for a in (q, k, v))
    pos = _pad_axis(positions.astype(jnp.int32), 1, seq, -1)
    seg = _pad_axis(segment_ids.astype(jnp.int32), 1, seq)
    interpret = interpreting() if interpret is None else interpret
    st = _Static(window, blocks, seq, 1.0 / math.sqrt(h), interpret)
    out = _flash(q, k, v, sinks, pos, seg, st)
    return out[:, :s, :, :h]


def flash_attention_on_mesh(q, k, v, sinks, positions, segment_ids, window, blocks=Blocks()):
    """`flash_attention` under the active mesh, if any. XLA cannot partition a Pallas
    kernel (it would gather the operands onto every device), so the kernel runs in
    shard_map over the batch and head axes of the logical rules: each device takes its
    rows and heads and the whole sequence."""
    interpret = interpreting()  # read here: the context does not reach into shard_map's trace
    local = lambda q, k, v, snk, pos, seg: flash_attention(
        q, k, v, snk, pos, seg, window, blocks=blocks, interpret=interpret
    )
    ctx = sharding.active()
    if ctx is None:
        return local(q, k, v, sinks, positions, segment_ids)
    mesh, rules = ctx
    spec = lambda names, a: sharding.fit_spec(sharding.logical_to_spec(names, rules), a.shape, mesh)
    q_spec = spec(("batch", "length", "heads", "head_dim"), q)
    kv_spec = spec(("batch", "length", "kv_heads", "head_dim"), k)
    split = lambda entry: sharding.split_axes(entry, mesh)
    if split(q_spec[1]) or split(q_spec[3]) or kv_spec[2] != q_spec[2]:
        raise ValueError(
            "config.kernels.attention='flash' needs the sequence and head_dim unsharded and query "
            f"and KV heads sharded alike; the rules give q {q_spec}, k {kv_spec}. Use 'blockwise'."
        )
    rows = P(q_spec[0], None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[2]), rows, rows),
        out_specs=q_spec,
        check_vma=False,
    )(q, k, v, sinks, positions, segment_ids)


def self_attention(q, k, v, sinks, *, positions, segment_ids, window, block):
    """The `attention` op's `flash` implementation (`block` is the XLA blockwise's)."""
    return flash_attention_on_mesh(q, k, v, sinks, positions, segment_ids, window)
