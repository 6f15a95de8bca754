"""The experts' operands and the XLA references of the expert ops.

Each chosen expert e computes, with gate/up de-interleaved from the reference's fused
gate_up projection:

    gate = min(x @ Wg_e + bg_e, limit);  up = clip(x @ Wu_e + bu_e, -limit, limit)
    y_e  = (gate * sigmoid(alpha * gate) * (up + 1)) @ Wo_e + bo_e

  gated_activation   the `gated_activation` op: the middle line, biases gathered per row
  moe_decode         the `moe_decode` op for decode-sized batches, which reads only the
                     chosen experts' weights: `pairwise` on streamed weights (CPU
                     inference), `gathered` on accelerators; larger batches are declined
                     (model/moe.py then sorts them into grouped matmuls)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from gpt_oss_train import sharding
from gpt_oss_train.arrays.layer_views import LayerView


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


def unsort_rows(y_sorted, order, lead: tuple[int, ...] | None = None):
    """y [n, ...] whose row i belongs at order[i] (order a permutation of n) -> the rows
    in place, by gathers both ways: XLA:TPU runs a row scatter of 16-bit data as 32-bit
    words (a converted copy of the whole buffer and twice its bytes), and the gradient
    of a gather by a permutation is the gather by its inverse, not a scatter-add. `lead`
    lays the n rows out as that many leading axes straight from the gather: reshaping
    rows afterwards is a copy on TPU when an axis is not whole tiles (k = 4 choices)."""
    n = order.shape[0]
    where = jnp.zeros_like(order).at[order].set(jnp.arange(n, dtype=order.dtype))
    return _permute_rows(y_sorted, where.reshape(lead or (n,)), order)


def weighted_sum(wts, y_sorted, order, out_bias=None, key=None):
    """sum_k w_k y_k per token, y given in `order` (sorted pairs) -> [t, d], float32 (or
    wider). The pairs are gathered choice-major, [k, t, d]: each choice's rows are then
    whole tiles and the sum is k elementwise passes (token-major [t, k, d] has a
    4-row axis that TPU pads and copies, in float32 for XLA's batched product). The
    weights take y's dtype, and so does every cotangent of the backward: autodiff would
    widen y to float32 for the weights' gradient, a [k, t, d] copy.

    With `out_bias` [E, d] and `key` [t k] (each pair's expert, token-major; E where no
    expert here took the pair): a pair's output is y + out_bias[key], and zero where key
    is E, whatever y holds there (rows a grouped matmul left unwritten). Applied here,
    after the un-sort, it costs no pass of its own over the sorted rows, forward or
    backward: the selects fuse into the sum and into the cotangent's product."""
    t, k = wts.shape
    choice_major = (order % k) * t + order // k  # pair (token i, choice j) -> j t + i
    y = unsort_rows(y_sorted[: t * k], choice_major, (k, t))
    key_kt = None if key is None else key.reshape(t, k).T
    return _row_major(_weighted(wts.T.astype(y.dtype), y, out_bias, key_kt))


def _row_major(x):
    """x laid out row-major, as a fresh array is by default. Left free, XLA:TPU lays the
    sum out as its consumers downstream prefer (the reduce-scatter, the residual stream:
    column-major) and copies the [k, t, d] outputs to match before summing them (728 MiB
    a layer in the 20b step, in the forward and again in the backward's recompute), and
    the float32 cotangent back; pinned row-major, none of these copies is made."""
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


def _pairs(y_td, bias, key_t, acc):
    """One choice's pair outputs [t, d] in `acc`: y, or y plus its expert's bias where an
    expert took the pair and zero where none did (a select: y may be anything there)."""
    if bias is None:
        return y_td.astype(acc)
    return jnp.where((key_t < bias.shape[0])[:, None], _biased(y_td, bias, key_t), 0.0)


@jax.custom_vjp
def _weighted(w_kt, y_ktd, bias, key_kt):
    acc = jnp.promote_types(y_ktd.dtype, jnp.float32)
    pair = lambda j: _pairs(y_ktd[j], bias, None if bias is None else key_kt[j], acc)
    out = w_kt[0].astype(acc)[:, None] * pair(0)
    for j in range(1, w_kt.shape[0]):
        out = out + w_kt[j].astype(acc)[:, None] * pair(j)
    return out


def _weighted_fwd(w_kt, y_ktd, bias, key_kt):
    return _weighted(w_kt, y_ktd, bias, key_kt), (w_kt, y_ktd, bias, key_kt)


def _weighted_bwd(res, g_td):
    """Every gradient from the output's cotangent rounded to y's dtype (float32 on CPU:
    exact), each accumulated in float32 and written in its operand's dtype; the bias's by
    a one-hot product over the pairs (zero rows where no expert took the pair)."""
    w_kt, y_ktd, bias, key_kt = res
    acc = jnp.promote_types(y_ktd.dtype, jnp.float32)
    g = g_td.astype(y_ktd.dtype).astype(acc)
    pair = lambda j: _pairs(y_ktd[j], bias, None if bias is None else key_kt[j], acc)
    gw = jnp.stack([jnp.sum(g * pair(j), axis=-1) for j in range(w_kt.shape[0])])
    gy = w_kt.astype(acc)[:, :, None] * g[None]
    if bias is None:
        return gw.astype(w_kt.dtype), gy.astype(y_ktd.dtype), None, None
    gy = jnp.where((key_kt < bias.shape[0])[:, :, None], gy, 0.0).astype(y_ktd.dtype)
    gb = _sum_by_expert(gy, key_kt, bias.shape[0])
    return gw.astype(w_kt.dtype), gy, gb.astype(bias.dtype), None


_weighted.defvjp(_weighted_fwd, _weighted_bwd)


def _sum_by_expert(g, experts, e: int):
    """g [..., D] summed by each row's expert (experts [...]) -> [E, D] in float32 (or
    wider), by a one-hot product, exact for 16-bit g. Rows whose expert is E are selected
    out first: they may hold anything, and 0 x NaN is NaN."""
    taken = jnp.where((experts < e)[..., None], g, jnp.zeros((), g.dtype))
    onehot = jax.nn.one_hot(experts, e, dtype=g.dtype)
    exact = None if g.dtype.itemsize < 4 else jax.lax.Precision.HIGHEST  # no rounding to 16 bits
    acc = jnp.promote_types(g.dtype, jnp.float32)
    return jnp.einsum("...e,...d->ed", onehot, taken, preferred_element_type=acc, precision=exact)


@jax.custom_vjp
def _permute_rows(y, rows, inverse):
    return y[rows]


def _permute_rows_fwd(y, rows, inverse):
    # where each of y's rows went in the (possibly several) leading axes of the result
    return y[rows], jnp.unravel_index(inverse, rows.shape)


def _permute_rows_bwd(inverse, g):
    return g[inverse], None, None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def glu(gate, up, limit: float, alpha: float):
    """The clamped SwiGLU of biased gate and up products (float32 in, float32 out)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (up + 1.0)


def gated_activation(gate, up, bias_gate, bias_up, experts, *, limit, alpha, dtype):
    """gate, up [R, F] (float32, or the compute dtype) of rows whose experts are `experts`
    [R], biases [E, F] -> the activation [R, F] in `dtype`, computed in float32. A row
    whose expert is E (none here took it) may hold anything; so may its activation."""
    act = glu(_row_bias(gate, bias_gate, experts), _row_bias(up, bias_up, experts), limit, alpha)
    return act.astype(dtype)


def finish_rows(y, out_bias, key):
    """Sorted rows' expert outputs y [R, D] plus each row's expert's bias [E, D], zero
    where key == E (no expert here took the row; y may be anything there)."""
    y_b = add_row_bias(y, out_bias, key)
    return jnp.where((key < out_bias.shape[0])[:, None], y_b, jnp.zeros((), y.dtype))


def add_row_bias(x, bias, experts):
    """x [R, D] plus each row's expert's bias [E, D], added in float32, in x's dtype
    (rows whose expert is E: undefined, and left out of the bias's gradient)."""
    return _row_bias(x, bias, experts).astype(x.dtype)


@jax.custom_vjp
def _row_bias(x, bias, experts):
    """`_biased`, with the one-hot bias gradient below."""
    return _biased(x, bias, experts)


def _biased(x, bias, experts):
    """x [R, F] plus each row's expert's bias, in float32 (or wider); a row whose expert
    is E gets the last one's (it is undefined)."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    return x.astype(acc) + _rows_of(bias.astype(acc), jnp.minimum(experts, bias.shape[0] - 1))


# Up to this many experts (a shard's, under expert parallelism) a row's bias is chosen by
# selects rather than gathered.
SELECT_MAX_EXPERTS = 16


def _rows_of(table, rows):
    """table [E, F] at rows [R] -> [R, F]. For a few experts, a chain of selects, which
    XLA fuses into the pass that adds it: XLA:TPU runs a gather as a pass of its own that
    writes the whole [R, F] out (a float32 [65536, 2880] buffer per bias and layer in the
    20b step)."""
    if table.shape[0] > SELECT_MAX_EXPERTS:
        return table[rows]
    out = jnp.broadcast_to(table[0], (rows.shape[0], table.shape[1]))
    for e in range(1, table.shape[0]):
        out = jnp.where((rows == e)[:, None], table[e], out)
    return out


def _row_bias_fwd(x, bias, experts):
    return _row_bias(x, bias, experts), (jnp.zeros((), x.dtype), bias, experts)


def _row_bias_bwd(res, g):
    """The bias gradient from the cotangent as rounded to x's dtype (x's own gradient),
    by a one-hot product: autodiff would scatter-add the float32 cotangent, keeping a
    float32 [R, F] buffer per product on the way. Rows whose expert is E are selected
    out inside the product (their cotangent may be anything: 0 x NaN is NaN); x's
    gradient keeps them, for consumers that skip those rows (the grouped matmuls)."""
    like, bias, experts = res
    gx = g.astype(like.dtype)
    return gx, _sum_by_expert(gx, experts, bias.shape[0]).astype(bias.dtype), None


_row_bias.defvjp(_row_bias_fwd, _row_bias_bwd)


# ----------------------------------------------------------------------------- decode batches

# Up to this many (token, choice) pairs, streamed weights (CPU inference) take the pairs
# one at a time (`pairwise`); from about 64 pairs the tiled grouped matmul, which reads
# each chosen expert once, is as fast (python -m gpt_oss_train.tools.bench_moe
# --mode=decode).
PAIRWISE_MAX_PAIRS = 32

# On GPU, XLA rewrites a matrix-vector product into a column reduction, which reads the
# gathered expert weights at a fraction of the memory bandwidth. Giving each product 16
# rows, 15 of them zero, makes it a batched GEMM instead, about twice as fast (profile in
# docs/PERFORMANCE.md). The extra FLOPs are free on a GPU at decode sizes but not on a
# CPU, so other platforms keep one row.
GPU_GEMV_ROWS = 16


def use_pairwise(tokens: int, k: int, w: ExpertWeights) -> bool:
    return isinstance(w.wi_gate, LayerView) and w.lora is None and tokens * k <= PAIRWISE_MAX_PAIRS


def use_gathered(tokens: int, k: int, num_experts: int) -> bool:
    """Whether a batch is decode-sized enough for `gathered`: on accelerators, while
    tokens x k <= experts / 4. Gathering copies each chosen expert, so it only pays while
    few experts are chosen in total; past that, grouped matmuls that read each expert once
    win. CPUs never gather: small batches take `pairwise`, the rest the grouped matmul."""
    return sharding.platform() != "cpu" and 4 * tokens * k <= num_experts


def moe_decode_accepts(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype):
    t, k = idx_tk.shape
    return use_pairwise(t, k, w) or use_gathered(t, k, w.wi_gate.shape[0])


def moe_decode(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype):
    """sum_j weights[t, j] * expert_{idx[t, j]}(x_t), float32 [T, D]."""
    t, k = idx_tk.shape
    impl = pairwise if use_pairwise(t, k, w) else gathered
    return impl(x_td, weights_tk, idx_tk, w, limit=limit, alpha=alpha, dtype=dtype)


def gathered(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype, rows=None):
    """Gather each (token, choice)'s expert weights and multiply directly: reads only the k
    chosen experts per token, which is what bounds a decode step, where grouped matmuls
    would touch every expert. `rows`: how many rows each product is padded to (default:
    GPU_GEMV_ROWS on a GPU, else 1)."""
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
    act = glu(gate, up, limit, alpha)
    y = matvec(act.astype(dtype), pick(w.wo)) + w.bo.astype(f32)[flat]
    if lo is not None and lo.a_out is not None:
        y = y + matvec(matvec(act.astype(dtype), lpick(lo.a_out)).astype(dtype), lpick(lo.b_out))
    return jnp.einsum("tk,tkd->td", weights_tk, y.reshape(t, k, -1))


def pairwise(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype):
    """Decode on a CPU: a loop over the (token, choice) pairs, each multiplying its token
    by its expert's three matrices read as slices of the weights: no gathered copy of
    all chosen experts, no tile loop per expert; the fastest XLA path up to ~8 tokens.
    Needs streamed weights (LayerViews): from a layer's sliced weights XLA would copy the
    whole layer before the loop. No LoRA (`gathered` has it)."""
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
        y = dot(glu(gate, up, limit, alpha).astype(dtype), w.wo[e]) + w.bo[e].astype(f32)
        return out.at[token].add(weights_tk[token, p % k] * y[0])

    return jax.lax.fori_loop(0, t * k, pair, jnp.zeros((t, x.shape[1]), f32))
