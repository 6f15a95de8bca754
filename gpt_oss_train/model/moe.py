"""Mixture-of-experts: routing and the expert computation, with three strategies.

Routing (float32): logits = x @ W_r + b_r; take the top-k logits; softmax over those k
only. Each selected expert computes the clamped SwiGLU FFN of kernels/xla/experts.py, and
the token's output is sum_k w_k y_k.

Strategies (config.moe_impl), all exact, differing in cost and sharding; the products
inside them are the kernel registry's operations (`grouped_matmul`, `gated_activation`,
`moe_decode`), so each platform's kernels run them:
  dense    every expert on every token, then weighted: E/k times the FLOPs. The
           obviously-correct reference, for tests and tiny models.
  ragged   decode-sized batches through only their chosen experts (`moe_decode`); else
           sort the (token, expert) pairs by expert and run grouped matmuls: FLOPs of
           the active experts only, forward and backward.
  sharded  `ragged`'s grouped matmuls inside `shard_map` with expert parallelism: each
           device holds E/expert experts (and a slice of the hidden dim over `tensor`) and
           computes the pairs routed to its experts; the `expert_parallel` op moves tokens
           to them and back (all-gather, or all-to-all of only the pairs each shard takes)
           and the partial outputs are summed over tensor. A shard's decode-sized rows
           take `moe_decode` instead where the chosen kernel runs per shard (the TPU's
           MXFP4 kernel: the experts read packed, not decoded to bfloat16 in HBM).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from gpt_oss_train import sharding
from gpt_oss_train.arrays.layer_views import whole
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.kernels import AUTO_KERNELS, Kernels, platforms
from gpt_oss_train.kernels.xla.experts import (
    ExpertLoRA,
    ExpertWeights,
    add_row_bias,
    glu,
    weighted_sum,
)
from gpt_oss_train.model import remat, streamed_weights


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


def dense_experts(
    x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype, kernels=AUTO_KERNELS
):
    """Reference: all experts on all tokens, combined with a [T, E] routing matrix, in
    plain XLA whatever the kernels (so it checks them)."""
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
    act = glu(gate + w.bi_gate.astype(f32), up + w.bi_up.astype(f32), limit, alpha)
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
    return jnp.einsum(
        f"{x_axes},teio->teo", x.astype(dtype), m[rows], preferred_element_type=jnp.float32
    )


def _grouped_low_rank(kernels: Kernels, x, a, b, group_sizes, dtype):
    """(x A_g) B_g per group of rows, float32 (A, B already in the groups' layout)."""
    xa = kernels.grouped_matmul(x, a.astype(dtype), group_sizes)
    return kernels.grouped_matmul(xa.astype(dtype), b.astype(dtype), group_sizes)


def _grouped_ffn(
    kernels: Kernels,
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
    sum(group_sizes) (if any; expert_r there is the experts' count) come out undefined,
    as the grouped matmul leaves them; the biases' gradients skip them. LoRA factors
    (w.lora) are grouped by lora_group_sizes (default group_sizes; several adapters:
    (expert, adapter) groups).
    Outputs float32, or the compute dtype where the platform keeps the products in it
    (platforms.Facts.expert_products_in_compute_dtype)."""
    x = x_rd.astype(dtype)
    out = dtype if platforms.facts().expert_products_in_compute_dtype else None
    product = lambda a, m, sizes: kernels.grouped_matmul(a, m, sizes, out_dtype=out)
    gate = checkpoint_name(product(x, w.wi_gate, group_sizes), remat.EXPERT_PRODUCTS)
    up = checkpoint_name(product(x, w.wi_up, group_sizes), remat.EXPERT_PRODUCTS)
    lo = w.lora
    lgs = group_sizes if lora_group_sizes is None else lora_group_sizes
    if lo is not None and lo.a_in is not None:
        xa = product(x, lo.a_in.astype(dtype), lgs).astype(dtype)
        gate = gate + product(xa, lo.b_gate.astype(dtype), lgs)
        up = up + product(xa, lo.b_up.astype(dtype), lgs)
    act = kernels.gated_activation(
        gate, up, w.bi_gate, w.bi_up, expert_r, limit=limit, alpha=alpha, dtype=dtype
    )
    y = checkpoint_name(product(act, w.wo, group_sizes), remat.EXPERT_PRODUCTS)
    if lo is not None and lo.a_out is not None:
        y = y + _grouped_low_rank(kernels, act, lo.a_out, lo.b_out, lgs, dtype)
    if add_out_bias:
        y = add_row_bias(y, w.bo, expert_r)
    return y


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


def grouped_experts(
    x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype, kernels=AUTO_KERNELS
):
    """Sort (token, choice) pairs by expert, grouped matmuls, un-sort, weighted sum."""
    t, k = idx_tk.shape
    num_experts = w.wi_gate.shape[0]
    flat = idx_tk.reshape(-1)
    key, lora_group_sizes, w = _adapter_groups(flat, k, num_experts, w)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    y = _grouped_ffn(
        kernels,
        x_td[order // k],
        flat[order],
        group_sizes,
        w,
        limit=limit,
        alpha=alpha,
        dtype=dtype,
        lora_group_sizes=lora_group_sizes,
    )
    return weighted_sum(weights_tk, y, order)  # back to (token, choice), then summed


def ragged_experts(
    x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype, kernels=AUTO_KERNELS
):
    """Dropless MoE at the cost of the experts used: decode-sized batches through their
    chosen experts only (the `moe_decode` op), larger ones `grouped_experts`."""
    common = dict(limit=limit, alpha=alpha, dtype=dtype)
    y = kernels.moe_decode(x_td, weights_tk, idx_tk, w, **common)
    if y is None:
        y = grouped_experts(x_td, weights_tk, idx_tk, w, kernels=kernels, **common)
    return y


def _spec_of(weight, dense_spec):
    """shard_map's spec for an expert weight: a packed one (an MXFP4 base's blocks and
    scales) derives its own from the dense [E, in, out] spec."""
    return weight.partition_spec(dense_spec) if hasattr(weight, "partition_spec") else dense_spec


def _weight_specs(w: ExpertWeights, spec) -> ExpertWeights:
    """The experts (and their LoRA factors, rank unsharded) shard over `exp` and `mlp`."""
    lora = None
    if w.lora is not None:
        specs = ExpertLoRA(
            a_in=spec("exp", None, None),
            b_gate=spec("exp", None, "mlp"),
            b_up=spec("exp", None, "mlp"),
            a_out=spec("exp", "mlp", None),
            b_out=spec("exp", None, None),
        )
        lora = ExpertLoRA(*(None if a is None else s for a, s in zip(w.lora, specs)))
    return ExpertWeights(
        wi_gate=_spec_of(w.wi_gate, spec("exp", None, "mlp")),
        bi_gate=spec("exp", "mlp"),
        wi_up=_spec_of(w.wi_up, spec("exp", None, "mlp")),
        bi_up=spec("exp", "mlp"),
        wo=_spec_of(w.wo, spec("exp", "mlp", None)),
        bo=spec("exp", None),
        lora=lora,
    )


# Where each expert matrix has its model dimension (`embed`, FSDP-sharded in storage).
_EMBED_DIM = {"wi_gate": 1, "wi_up": 1, "wo": 2}


def _fsdp_gathers(w: ExpertWeights, spec, mesh, taken: tuple[str, ...]) -> dict:
    """name -> the mesh axes its stored `embed` dimension is split over (and not already
    used by experts or mlp), for the plain (not packed) expert matrices: shard_map takes
    them so split and gathers them inside, so their gradients come back reduce-scattered."""
    out = {}
    for name, dim in _EMBED_DIM.items():
        weight = getattr(w, name)
        if hasattr(weight, "partition_spec"):  # an MXFP4 base: frozen, no gradient
            continue
        names = ["exp", "mlp", "mlp"]
        names[dim] = "embed"
        stored = sharding.fit_spec(spec(*names), weight.shape, mesh)[dim]
        axes = tuple(a for a in sharding.spec_axes(stored) if a not in taken)
        if axes:
            out[name] = axes
    return out


def _local_experts(kernels, x, wts, idx, lw, *, axes, local_e, ffn, gathers, capacity_factor):
    """One device's part of `sharded_experts`, inside shard_map: its tokens through the
    experts they chose, wherever those live (the `expert_parallel` op moves them)."""
    exp_axes, mlp_axes, token_axes = axes
    lw = lw._replace(
        **{
            n: sharding.gather_weight(getattr(lw, n), ax, _EMBED_DIM[n], ffn["dtype"])
            for n, ax in gathers.items()
        }
    )
    # The output bias is added by one tensor shard only, so the psum adds it once.
    add_bias = sharding.axes_index(mlp_axes) == 0
    out_bias = jnp.where(add_bias, lw.bo, jnp.zeros((), lw.bo.dtype))

    def experts(rows, key, group_sizes):
        y = _decode_local_rows(kernels, rows, key, lw, **ffn)
        if y is None:
            y = _grouped_ffn(kernels, rows, key, group_sizes, lw, add_out_bias=False, **ffn)
        return y

    return kernels.expert_parallel(
        experts,
        x,
        wts,
        idx,
        local_e=local_e,
        expert_axes=exp_axes,
        token_axes=token_axes,
        mlp_axes=mlp_axes,
        out_bias=out_bias,
        capacity_factor=capacity_factor,
    )


def _decode_local_rows(kernels, rows, key, w: ExpertWeights, *, limit, alpha, dtype):
    """A shard's rows [R, d] through its local experts by the `moe_decode` op, where the
    chosen kernel runs per shard and takes them (Kernels.moe_decode_per_shard); else None.
    Each row is one pair of weight 1 with its expert `key` (expert_parallel's; the local
    experts' count on the receive buffer's padding rows, which weigh 0 and take the
    highest real row's expert, so they fetch no other). Without the output bias:
    expert_parallel adds it, once over the tensor shards."""
    real = key < w.bo.shape[0]
    expert = jnp.where(real, key, jnp.max(jnp.where(real, key, 0)))
    return kernels.moe_decode_per_shard(
        rows,
        real.astype(jnp.float32)[:, None],
        expert[:, None],
        w._replace(bo=jnp.zeros_like(w.bo)),
        limit=limit,
        alpha=alpha,
        dtype=dtype,
    )


def sharded_experts(
    x_td,
    weights_tk,
    idx_tk,
    w: ExpertWeights,
    *,
    limit,
    alpha,
    dtype,
    kernels=AUTO_KERNELS,
    capacity_factor=0.0,
):
    """Expert parallelism under shard_map (see module docstring). Falls back to `ragged`
    without an active mesh. capacity_factor: config.moe_capacity_factor."""
    ffn = dict(limit=limit, alpha=alpha, dtype=dtype)
    ctx = sharding.active()
    if ctx is None:
        return ragged_experts(x_td, weights_tk, idx_tk, w, kernels=kernels, **ffn)
    mesh, rules = ctx
    w = w._replace(**{n: whole(getattr(w, n)) for n in streamed_weights.EXPERTS})
    spec = lambda *names: sharding.logical_to_spec(names, rules)
    # Tokens are the [batch, length] rows flattened, so split over the batch's axes and then
    # the sequence's (context parallelism); decode batches may not divide them: keep only
    # the axes that divide.
    row_axes = sharding.spec_axes(spec("batch")[0]) + sharding.spec_axes(spec("length")[0])
    tok = sharding.fit_spec(P(sharding.spec_entry(row_axes), None), x_td.shape, mesh)
    exp_spec = spec("exp", None, "mlp")
    exp_axes, mlp_axes = sharding.spec_axes(exp_spec[0]), sharding.spec_axes(exp_spec[2])
    # The batch axes that also shard experts: tokens move between these devices to reach
    # their experts, and stay sharded over the rest of the batch axes.
    token_axes = tuple(a for a in sharding.spec_axes(tok[0]) if a in exp_axes)
    num_experts = w.wi_gate.shape[0]
    n_exp_shards = math.prod(mesh.shape[a] for a in exp_axes)
    if num_experts % n_exp_shards:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the {n_exp_shards} "
            f"devices of mesh axes {exp_axes} that shard experts"
        )
    if w.lora is not None and w.lora.rows is not None:
        raise ValueError(
            "several adapters in one batch need moe_impl 'ragged' or 'dense' (not 'sharded')"
        )
    gathers = _fsdp_gathers(w, spec, mesh, exp_axes + mlp_axes)
    w_specs = _weight_specs(w, spec)
    for name, ax in gathers.items():
        entries = list(getattr(w_specs, name))
        entries[_EMBED_DIM[name]] = sharding.spec_entry(ax)
        w_specs = w_specs._replace(**{name: P(*entries)})
    local = lambda x, wts, idx, lw: _local_experts(
        kernels,
        x,
        wts,
        idx,
        lw,
        axes=(exp_axes, mlp_axes, token_axes),
        local_e=num_experts // n_exp_shards,
        ffn=ffn,
        gathers=gathers,
        capacity_factor=capacity_factor,
    )
    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(tok, tok, tok, w_specs), out_specs=tok, check_vma=False
    )
    return fn(x_td, weights_tk, idx_tk, w)


EXPERT_IMPLS = {"dense": dense_experts, "ragged": ragged_experts, "sharded": sharded_experts}


def check_impl(name: str) -> None:
    """config.moe_impl's one-line error for a name EXPERT_IMPLS lacks. The names are
    declared here alone: config, below the model, cannot see them, so the model checks
    them when it is built (ModelDef), before any compute."""
    if name not in EXPERT_IMPLS:
        raise ConfigError(f"config.moe_impl: {name!r} is not one of {tuple(EXPERT_IMPLS)}")
