"""Mixture-of-experts: routing and the expert computation, with three back-ends.

Routing (float32): logits = x @ W_r + b_r; take the top-k logits; softmax over those k
only. Each selected expert e computes, with gate/up de-interleaved from the reference's
fused gate_up projection:

    gate = min(x @ Wg_e + bg_e, limit);  up = clip(x @ Wu_e + bu_e, -limit, limit)
    y_e  = (gate * sigmoid(alpha * gate) * (up + 1)) @ Wo_e + bo_e

and the token's output is sum_k w_k y_k.

Back-ends (config.moe_impl), all exact, differing in cost and sharding:
  dense    every expert on every token, then weighted: E/k times the FLOPs. The
           obviously-correct reference, for tests and tiny models.
  ragged   sort the (token, expert) pairs by expert and run grouped matmuls with the
           platform's fastest kernel (grouped_matmul.py: tiles on CPUs and GPUs, the
           native ragged dot on TPUs, Mosaic on Hopper): FLOPs of the active experts
           only, forward and backward. Decode-sized batches gather the chosen experts'
           weights instead on accelerators (`use_gathered`); on CPUs one custom call
           runs the whole layer (cpu_kernels/moe_decode.py), or where it does not apply
           the (token, choice) pairs go one at a time (`use_pairwise`).
  sharded  `ragged` inside `shard_map` with expert parallelism: each device holds
           E/expert experts (and a slice of the hidden dim over `tensor`), computes the
           pairs routed to its experts for the tokens of its `expert` group, and the
           partial outputs are summed (psum over tensor, reduce-scatter over expert).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gpt_oss_train import sharding
from gpt_oss_train.model import remat, streamed_weights
from gpt_oss_train.model.cpu_kernels import glu as cpu_glu
from gpt_oss_train.model.cpu_kernels import moe_decode as cpu_moe_decode
from gpt_oss_train.model.grouped_matmul import grouped_matmul


class ExpertLoRA(NamedTuple):
    """Low-rank pairs added to each expert's matmuls (model/lora.py): gate += (x A_in)
    B_gate, up += (x A_in) B_up, out += (act A_out) B_out, their scale folded into the Bs.
    A pair may be None (target not adapted). With `rows` (stacked adapters), every array
    has a leading adapter axis and token t uses adapter rows[t]."""

    a_in: jax.Array | None = None  # [(n,) E, D, r]
    b_gate: jax.Array | None = None  # [(n,) E, r, F]
    b_up: jax.Array | None = None  # [(n,) E, r, F]
    a_out: jax.Array | None = None  # [(n,) E, F, r]
    b_out: jax.Array | None = None  # [(n,) E, r, D]
    rows: jax.Array | None = None  # [T] int32: each token's adapter


class ExpertWeights(NamedTuple):
    wi_gate: jax.Array  # [E, D, F]
    bi_gate: jax.Array  # [E, F]
    wi_up: jax.Array  # [E, D, F]
    bi_up: jax.Array  # [E, F]
    wo: jax.Array  # [E, F, D]
    bo: jax.Array  # [E, D]
    lora: ExpertLoRA | None = None


def route(x_td, kernel, bias, k: int, delta=None):
    """Top-k routing in float32. Returns (weights [T,k] f32, experts [T,k] i32, logits).
    `delta` [T, E] (a LoRA adapter's) is added to the logits before the choice."""
    logits = jnp.dot(
        x_td.astype(jnp.float32), kernel.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    ) + bias.astype(jnp.float32)
    if delta is not None:
        logits = logits + delta
    top_logits, top_idx = jax.lax.top_k(logits, k)
    return jax.nn.softmax(top_logits, axis=-1), top_idx.astype(jnp.int32), logits


def load_balancing_loss(logits_te, top_idx_tk, valid_t):
    """Switch-style auxiliary loss, E * sum_e f_e * p_e, over valid (non-padding) tokens:
    f_e = share of top-k assignments that went to expert e (sums to k), p_e = mean router
    probability of e. Equals k when routing is perfectly balanced."""
    num_experts = logits_te.shape[-1]
    valid = valid_t.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(valid), 1.0)
    assigned = jnp.sum(jax.nn.one_hot(top_idx_tk, num_experts, dtype=jnp.float32), axis=1)
    f = jnp.sum(assigned * valid[:, None], axis=0) / n
    p = jnp.sum(jax.nn.softmax(logits_te, axis=-1) * valid[:, None], axis=0) / n
    return num_experts * jnp.sum(f * p)


def _glu(gate, up, limit: float, alpha: float):
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (up + 1.0)


def dense_experts(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype):
    """Reference: all experts on all tokens, combined with a [T, E] routing matrix."""
    t = x_td.shape[0]
    num_experts = w.wi_gate.shape[0]
    x = x_td.astype(dtype)
    f32 = jnp.promote_types(dtype, jnp.float32)  # float64 when the reference runs in it
    gate = jnp.einsum("td,edf->tef", x, w.wi_gate.astype(dtype), preferred_element_type=f32)
    up = jnp.einsum("td,edf->tef", x, w.wi_up.astype(dtype), preferred_element_type=f32)
    lo = w.lora
    if lo is not None and lo.a_in is not None:
        xa = _dense_low_rank(x, lo.a_in, lo.rows, "ti", dtype)
        gate = gate + _dense_low_rank(xa, lo.b_gate, lo.rows, "tei", dtype)
        up = up + _dense_low_rank(xa, lo.b_up, lo.rows, "tei", dtype)
    act = _glu(gate + w.bi_gate.astype(f32), up + w.bi_up.astype(f32), limit, alpha)
    y = jnp.einsum(
        "tef,efd->ted", act.astype(dtype), w.wo.astype(dtype), preferred_element_type=f32
    ) + w.bo.astype(f32)
    if lo is not None and lo.a_out is not None:
        aa = _dense_low_rank(act.astype(dtype), lo.a_out, lo.rows, "tei", dtype)
        y = y + _dense_low_rank(aa, lo.b_out, lo.rows, "tei", dtype)
    combine = (
        jnp.zeros((t, num_experts), f32)
        .at[jnp.arange(t)[:, None], idx_tk]
        .add(weights_tk.astype(f32))
    )
    return jnp.einsum("te,ted->td", combine, y)


def _dense_low_rank(x, m, rows, x_axes: str, dtype):
    """x [t, (e,) i] ("ti" or "tei") times an expert-stacked LoRA factor m [(n,) e, i, o]
    -> [t, e, o] float32; with rows, token t uses m[rows[t]]."""
    m = m.astype(dtype)
    if rows is None:
        return jnp.einsum(
            f"{x_axes},eio->teo", x.astype(dtype), m, preferred_element_type=jnp.float32
        )
    return jnp.einsum(f"{x_axes},teio->teo", x.astype(dtype), m[rows],
                      preferred_element_type=jnp.float32)  # fmt: skip


def _grouped_low_rank(x, a, b, group_sizes, dtype):
    """(x A_g) B_g per group of rows, float32 (A, B already in the groups' layout)."""
    xa = grouped_matmul(x, a.astype(dtype), group_sizes)
    return grouped_matmul(xa.astype(dtype), b.astype(dtype), group_sizes)


def _grouped_ffn(
    x_rd,
    expert_r,
    group_sizes,
    w: ExpertWeights,
    *,
    limit,
    alpha,
    dtype,
    add_out_bias=True,
    lora_group_sizes=None,
):
    """Rows already sorted by expert; group_sizes[e] rows belong to expert e. Rows past
    sum(group_sizes) (if any) come out as zeros. LoRA factors (w.lora) are grouped by
    lora_group_sizes (default group_sizes; several adapters: (expert, adapter) groups)."""
    f32 = jnp.float32
    x = x_rd.astype(dtype)
    gate = checkpoint_name(grouped_matmul(x, w.wi_gate, group_sizes), remat.EXPERT_PRODUCTS)
    up = checkpoint_name(grouped_matmul(x, w.wi_up, group_sizes), remat.EXPERT_PRODUCTS)
    lo = w.lora
    lgs = group_sizes if lora_group_sizes is None else lora_group_sizes
    if lo is not None and lo.a_in is not None:
        xa = grouped_matmul(x, lo.a_in.astype(dtype), lgs).astype(dtype)
        gate = gate + grouped_matmul(xa, lo.b_gate.astype(dtype), lgs)
        up = up + grouped_matmul(xa, lo.b_up.astype(dtype), lgs)
    e = jnp.clip(expert_r, 0, w.bi_gate.shape[0] - 1)
    if cpu_glu.applies(gate, w.bi_gate, dtype):  # bias gathers and their gradients inside
        act = cpu_glu.glu(gate, up, w.bi_gate, w.bi_up, e, limit=limit, alpha=alpha)
    else:
        act = _glu(gate + w.bi_gate.astype(f32)[e], up + w.bi_up.astype(f32)[e], limit, alpha)
    y = checkpoint_name(grouped_matmul(act.astype(dtype), w.wo, group_sizes), remat.EXPERT_PRODUCTS)
    if lo is not None and lo.a_out is not None:
        y = y + _grouped_low_rank(act.astype(dtype), lo.a_out, lo.b_out, lgs, dtype)
    if add_out_bias:
        y = y + w.bo.astype(f32)[e]
    return y


# On GPU, XLA rewrites a matrix-vector product into a column reduction, which reads the
# gathered expert weights at a fraction of the memory bandwidth. Giving each product 16
# rows, 15 of them zero, makes it a batched GEMM instead, about twice as fast (profile in
# docs/PERFORMANCE.md). The extra FLOPs are free on a GPU at decode sizes but not on a
# CPU, so other platforms keep one row.
GPU_GEMV_ROWS = 16


def gathered_ffn(
    x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype, rows: int | None = None
):
    """Decode-sized batches (tokens x k <= experts / 4): gather each (token, choice)'s expert
    weights and multiply directly. Reads only the k chosen experts per token, which is
    what bounds a decode step, where grouped matmuls would touch every expert. `rows`: how
    many rows each product is padded to (default: GPU_GEMV_ROWS on a GPU, else 1)."""
    f32 = jnp.float32
    t, k = idx_tk.shape
    m = rows or (GPU_GEMV_ROWS if sharding.platform() == "gpu" else 1)
    flat = idx_tk.reshape(-1)  # one product per (token, choice), token-major
    pick = lambda a: a[flat].astype(dtype)  # [t*k, ...]; an int8 QArray gathers int8

    def matvec(v_rd, w_rdf):  # [r, d] x [r, d, f] -> [r, f], as m-row products
        v = jnp.pad(v_rd[:, None], ((0, 0), (0, m - 1), (0, 0)))
        return jnp.einsum("rmd,rdf->rmf", v, w_rdf, preferred_element_type=f32)[:, 0]

    x = jnp.repeat(x_td.astype(dtype), k, axis=0)
    gate = matvec(x, pick(w.wi_gate)) + w.bi_gate.astype(f32)[flat]
    up = matvec(x, pick(w.wi_up)) + w.bi_up.astype(f32)[flat]
    lo = w.lora
    if lo is not None:
        # each (token, choice)'s own factors: [t*k, in, r] and [t*k, r, out]
        pair = flat if lo.rows is None else (jnp.repeat(lo.rows, k), flat)
        lpick = lambda a: a[pair].astype(dtype)
    if lo is not None and lo.a_in is not None:
        xa = matvec(x, lpick(lo.a_in)).astype(dtype)
        gate = gate + matvec(xa, lpick(lo.b_gate))
        up = up + matvec(xa, lpick(lo.b_up))
    act = _glu(gate, up, limit, alpha)
    y = matvec(act.astype(dtype), pick(w.wo)) + w.bo.astype(f32)[flat]
    if lo is not None and lo.a_out is not None:
        y = y + matvec(matvec(act.astype(dtype), lpick(lo.a_out)).astype(dtype), lpick(lo.b_out))
    return jnp.einsum("tk,tkd->td", weights_tk, y.reshape(t, k, -1))


# Up to this many (token, choice) pairs, streamed weights (CPU inference) take the pairs
# one at a time (`pairwise_ffn`); from about 64 pairs the tiled grouped matmul, which
# reads each chosen expert once, is as fast (tools/moe_benchmark.py --mode=decode).
PAIRWISE_MAX_PAIRS = 32


def pairwise_ffn(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype):
    """Decode on a CPU: a loop over the (token, choice) pairs, each multiplying its token
    by its expert's three matrices read as slices of the weights: no gathered copy of
    all chosen experts, no tile loop per expert; the fastest XLA path up to ~8 tokens
    (tools/moe_benchmark.py --mode=decode). Needs streamed weights
    (model/streamed_weights.py): from a layer's sliced weights XLA would copy the whole
    layer before the loop. No LoRA (`gathered_ffn` has it)."""
    f32 = jnp.float32
    t, k = idx_tk.shape
    x = x_td.astype(dtype)
    flat = idx_tk.reshape(-1)
    dot = lambda a, m: jnp.dot(a, m.astype(dtype), preferred_element_type=f32)

    def pair(p, out):
        token, e = p // k, flat[p]
        row = jax.lax.dynamic_slice_in_dim(x, token, 1)  # [1, D]
        gate = dot(row, w.wi_gate[e]) + w.bi_gate[e].astype(f32)
        up = dot(row, w.wi_up[e]) + w.bi_up[e].astype(f32)
        y = dot(_glu(gate, up, limit, alpha).astype(dtype), w.wo[e]) + w.bo[e].astype(f32)
        return out.at[token].add(weights_tk[token, p % k] * y[0])

    return jax.lax.fori_loop(0, t * k, pair, jnp.zeros((t, x.shape[1]), f32))


def use_pairwise(tokens: int, k: int, w: ExpertWeights) -> bool:
    return (
        isinstance(w.wi_gate, streamed_weights.LayerView)
        and w.lora is None
        and tokens * k <= PAIRWISE_MAX_PAIRS
    )


def use_gathered(tokens: int, k: int, num_experts: int) -> bool:
    """Whether a batch is decode-sized enough for `gathered_ffn`: on accelerators, while
    tokens x k <= experts / 4. Gathering copies each chosen expert, so it only pays while
    few experts are chosen in total; past that, grouped matmuls that read each expert once
    win. CPUs never gather: small batches take `pairwise_ffn`, the rest the tiled grouped
    matmul (figures in docs/PERFORMANCE.md)."""
    return sharding.platform() != "cpu" and 4 * tokens * k <= num_experts


def _adapter_groups(flat, k: int, num_experts: int, w: ExpertWeights):
    """Stacked adapters in a grouped matmul: pairs sort by (expert, adapter), so rows stay
    grouped by expert for the base weights and by (expert, adapter) for the LoRA factors,
    which are laid out [E * n, ...] to match. Returns (sort key, LoRA group sizes or None,
    the weights with the factors so laid out)."""
    lo = w.lora
    if lo is None or lo.rows is None:
        return flat, None, w
    n = next(a for a in lo[:5] if a is not None).shape[0]
    key = flat * n + jnp.repeat(lo.rows, k)
    regroup = lambda a: None if a is None else jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:])
    lora = ExpertLoRA(*(regroup(a) for a in lo[:5]), rows=None)
    sizes = jnp.bincount(key, length=num_experts * n).astype(jnp.int32)
    return key, sizes, w._replace(lora=lora)


def grouped_experts(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype):
    """Sort (token, choice) pairs by expert, grouped matmuls, un-sort, weighted sum."""
    t, k = idx_tk.shape
    num_experts = w.wi_gate.shape[0]
    flat = idx_tk.reshape(-1)
    key, lora_group_sizes, w = _adapter_groups(flat, k, num_experts, w)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    y = _grouped_ffn(
        x_td[order // k],
        flat[order],
        group_sizes,
        w,
        limit=limit,
        alpha=alpha,
        dtype=dtype,
        lora_group_sizes=lora_group_sizes,
    )
    y = jnp.zeros_like(y).at[order].set(y).reshape(t, k, -1)  # back to (token, choice)
    return jnp.einsum("tk,tkd->td", weights_tk, y)


def ragged_experts(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype):
    """Dropless MoE at the cost of the experts used: `grouped_experts`, or for
    decode-sized batches the CPU kernel (cpu_kernels/moe_decode.py), `pairwise_ffn`
    (streamed weights it does not take) or `gathered_ffn` (`use_gathered`)."""
    t, k = idx_tk.shape
    if cpu_moe_decode.applies(t, k, w, dtype):
        return cpu_moe_decode.moe_decode(x_td, weights_tk, idx_tk, w, limit=limit, alpha=alpha)
    if use_pairwise(t, k, w):
        impl = pairwise_ffn
    elif use_gathered(t, k, w.wi_gate.shape[0]):
        impl = gathered_ffn
    else:
        impl = grouped_experts
    return impl(x_td, weights_tk, idx_tk, w, limit=limit, alpha=alpha, dtype=dtype)


def _spec_of(weight, dense_spec):
    """shard_map's spec for an expert weight: a packed one (an MXFP4 base's blocks and
    scales) derives its own from the dense [E, in, out] spec."""
    return weight.partition_spec(dense_spec) if hasattr(weight, "partition_spec") else dense_spec


def _lora_specs(lo: ExpertLoRA | None, spec) -> ExpertLoRA | None:
    """The LoRA factors shard like the expert weights they adapt (rank unsharded)."""
    if lo is None:
        return None
    specs = ExpertLoRA(
        a_in=spec("exp", None, None),
        b_gate=spec("exp", None, "mlp"),
        b_up=spec("exp", None, "mlp"),
        a_out=spec("exp", "mlp", None),
        b_out=spec("exp", None, None),
    )
    return ExpertLoRA(*(None if a is None else s for a, s in zip(lo, specs)))


def sharded_experts(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype):
    """Expert parallelism under shard_map (see module docstring). Falls back to `ragged`
    without an active mesh."""
    ctx = sharding.active()
    if ctx is None:
        return ragged_experts(x_td, weights_tk, idx_tk, w, limit=limit, alpha=alpha, dtype=dtype)
    mesh, rules = ctx
    w = w._replace(**{n: streamed_weights.whole(getattr(w, n)) for n in streamed_weights.EXPERTS})
    spec = lambda *names: sharding.logical_to_spec(names, rules)
    # Decode batches may not divide the batch shards: keep only the axes that divide.
    tok = sharding.fit_spec(spec("batch", None), x_td.shape, mesh)
    exp_spec = spec("exp", None, "mlp")
    exp_axes = sharding.spec_axes(exp_spec[0])
    mlp_axes = sharding.spec_axes(exp_spec[2])
    tok_axes = sharding.spec_axes(tok[0])
    # Tokens are gathered over the axes that shard experts (each device then sees every
    # token its experts may receive) and stay sharded over the rest of the batch axes.
    gather_axes = tuple(a for a in tok_axes if a in exp_axes)
    num_experts = w.wi_gate.shape[0]
    n_exp_shards = math.prod(mesh.shape[a] for a in exp_axes)
    local_e = num_experts // n_exp_shards
    if num_experts % n_exp_shards:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the {n_exp_shards} "
            f"devices of mesh axes {exp_axes} that shard experts"
        )
    if w.lora is not None and w.lora.rows is not None:
        raise ValueError(
            "several adapters in one batch need moe_impl 'ragged' or 'dense' (not 'sharded')"
        )
    w_specs = ExpertWeights(
        wi_gate=_spec_of(w.wi_gate, spec("exp", None, "mlp")),
        bi_gate=spec("exp", "mlp"),
        wi_up=_spec_of(w.wi_up, spec("exp", None, "mlp")),
        bi_up=spec("exp", "mlp"),
        wo=_spec_of(w.wo, spec("exp", "mlp", None)),
        bo=spec("exp", None),
        lora=_lora_specs(w.lora, spec),
    )

    def local(x, wts, idx, lw):
        for ax in gather_axes:
            x, wts, idx = (jax.lax.all_gather(a, ax, axis=0, tiled=True) for a in (x, wts, idx))
        t, k = idx.shape
        shard = sharding.axes_index(exp_axes)
        first = shard * local_e
        flat = idx.reshape(-1) - first
        mine = (flat >= 0) & (flat < local_e)
        key = jnp.where(mine, flat, local_e)  # not-mine rows sort to the end
        order = jnp.argsort(key, stable=True)
        group_sizes = jnp.bincount(key, length=local_e + 1)[:local_e].astype(jnp.int32)
        # The output bias is added by one tensor shard only, so the psum adds it once.
        add_bias = sharding.axes_index(mlp_axes) == 0
        y = _grouped_ffn(
            x[order // k],
            key[order],
            group_sizes,
            lw,
            limit=limit,
            alpha=alpha,
            dtype=dtype,
            add_out_bias=False,
        )
        y = y + jnp.where(
            add_bias, lw.bo.astype(jnp.float32)[jnp.clip(key[order], 0, local_e - 1)], 0.0
        )
        y = jnp.where(mine[order][:, None], y, 0.0)
        y = jnp.zeros_like(y).at[order].set(y).reshape(t, k, -1)
        out = jnp.einsum("tk,tkd->td", wts, y)
        if mlp_axes:
            out = jax.lax.psum(out, mlp_axes)
        for ax in reversed(gather_axes):
            out = jax.lax.psum_scatter(out, ax, scatter_dimension=0, tiled=True)
        others = tuple(a for a in exp_axes if a not in gather_axes)
        if others:  # experts sharded over an axis that does not shard tokens
            out = jax.lax.psum(out, others)
        return out

    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(tok, tok, tok, w_specs), out_specs=tok, check_vma=False
    )
    return fn(x_td, weights_tk, idx_tk, w)


EXPERT_IMPLS = {"dense": dense_experts, "ragged": ragged_experts, "sharded": sharded_experts}
