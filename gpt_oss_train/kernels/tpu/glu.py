"""The `gated_activation` op's `pallas` implementation for TPUs: XLA's forward (it fuses
into the pass that feeds the down projection), and a backward in one Pallas kernel that
reads gate, up and the activation's cotangent once and writes both gradients and both
biases' per-expert sums.

Why: XLA:TPU splits the reference's backward into one fusion per gradient, each reading
gate, up and the cotangent again: eight passes over the `[rows, F]` expert rows a layer
where this kernel makes five (docs/AOT.md has the step's figures). Under expert
parallelism the rows are sized for the worst routing, so each pass is paid for every row
a shard could receive. The cost: both gradients are live at once, one more `[rows, F]`
buffer at the peak than XLA's schedule of the two fusions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gpt_oss_train import sharding
from gpt_oss_train.kernels.xla import experts as xla_experts

ROWS = 128  # rows per block: five double-buffered [128, F] bf16 blocks and the f32 math fit VMEM
CORES = 2  # the row blocks split into this many independent runs (v5p's two TensorCores)
MAX_EXPERTS = xla_experts.SELECT_MAX_EXPERTS  # a row's bias is chosen by selects


def accepts(gate, up, bias_gate, bias_up, experts, *, limit, alpha, dtype) -> bool:
    """bf16 products and activation, a shard's few experts, rows in whole blocks, and one
    device's arrays (inside shard_map, as expert parallelism calls it, or a 1-device mesh)."""
    return (
        gate.dtype == up.dtype == jnp.bfloat16
        and jnp.dtype(dtype) == jnp.bfloat16
        and bias_gate.shape[0] <= MAX_EXPERTS
        and gate.shape[0] % (ROWS * CORES) == 0
        and sharding.per_device()
    )


def gated_activation(gate, up, bias_gate, bias_up, experts, *, limit, alpha, dtype):
    interpret = sharding.platform() != "tpu"  # tests on a CPU: Pallas' interpreter
    return _act(
        gate,
        up,
        bias_gate,
        bias_up,
        experts,
        float(limit),
        float(alpha),
        jnp.dtype(dtype),
        interpret,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _act(gate, up, bias_gate, bias_up, experts, limit, alpha, dtype, interpret):
    return xla_experts.gated_activation(
        gate, up, bias_gate, bias_up, experts, limit=limit, alpha=alpha, dtype=dtype
    )


def _act_fwd(gate, up, bias_gate, bias_up, experts, limit, alpha, dtype, interpret):
    act = _act(gate, up, bias_gate, bias_up, experts, limit, alpha, dtype, interpret)
    return act, (gate, up, bias_gate, bias_up, experts)


def _act_bwd(limit, alpha, dtype, interpret, res, d_act):
    gate, up, bias_gate, bias_up, experts = res
    dg, du, dbg, dbu = backward(
        gate,
        up,
        bias_gate,
        bias_up,
        experts,
        d_act.astype(gate.dtype),
        limit=limit,
        alpha=alpha,
        interpret=interpret,
    )
    return dg, du, dbg.astype(bias_gate.dtype), dbu.astype(bias_up.dtype), None


_act.defvjp(_act_fwd, _act_bwd)


def backward(gate, up, bias_gate, bias_up, experts, d_act, *, limit, alpha, interpret=False):
    """gate, up, d_act [R, F] bf16, biases [E, F], experts [R] (E: no expert here, the row
    undefined) -> (d_gate, d_up [R, F] bf16, d_bias_gate, d_bias_up [E, F] float32). The
    bias sums take the gradients as rounded to bf16 and skip rows whose expert is E."""
    from jax.experimental.pallas import tpu as pltpu  # lazy: optional dependency (Pallas TPU)

    (r, f), e = gate.shape, bias_gate.shape[0]
    steps = r // (ROWS * CORES)
    experts = experts.astype(jnp.int32)
    rows = lambda c, i: (c * steps + i, 0)
    row_block = pl.BlockSpec((ROWS, f), rows)
    whole = lambda shape: pl.BlockSpec(shape, lambda c, i: (0,) * len(shape))
    sums = pl.BlockSpec((None, e, f), lambda c, i: (c, 0, 0))  # one partial sum per run
    kernel = functools.partial(_backward_kernel, limit=limit, alpha=alpha)
    d_gate, d_up, d_bg, d_bu = pl.pallas_call(
        kernel,
        grid=(CORES, steps),
        in_specs=[
            row_block,
            row_block,
            row_block,
            pl.BlockSpec((ROWS, 1), rows),  # experts as a column: the row selects
            pl.BlockSpec((1, ROWS), lambda c, i: (0, c * steps + i)),  # and a row: one-hots
            whole((e, f)),
            whole((e, f)),
        ],
        out_specs=[row_block, row_block, sums, sums],
        out_shape=[
            jax.ShapeDtypeStruct((r, f), gate.dtype),
            jax.ShapeDtypeStruct((r, f), up.dtype),
            jax.ShapeDtypeStruct((CORES, e, f), jnp.float32),
            jax.ShapeDtypeStruct((CORES, e, f), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name="glu_backward",
        cost_estimate=pl.CostEstimate(
            flops=30 * r * f + 4 * r * e * f,
            transcendentals=r * f,
            bytes_accessed=5 * r * f * gate.dtype.itemsize,
        ),
        interpret=interpret,
    )(
        gate,
        up,
        d_act,
        experts.reshape(r, 1),
        experts.reshape(1, r),
        bias_gate.astype(jnp.float32),
        bias_up.astype(jnp.float32),
    )
    return d_gate, d_up, d_bg.sum(0), d_bu.sum(0)


def _backward_kernel(
    gate_ref,
    up_ref,
    d_act_ref,
    e_col_ref,
    e_row_ref,
    bg_ref,
    bu_ref,
    d_gate_ref,
    d_up_ref,
    d_bg_ref,
    d_bu_ref,
    *,
    limit,
    alpha,
):
    @pl.when(pl.program_id(1) == 0)
    def _():
        d_bg_ref[...] = jnp.zeros_like(d_bg_ref)
        d_bu_ref[...] = jnp.zeros_like(d_bu_ref)

    f32 = jnp.float32
    e_col = e_col_ref[...]  # [ROWS, 1]
    g = gate_ref[...].astype(f32) + _row_bias(bg_ref, e_col)
    u = up_ref[...].astype(f32) + _row_bias(bu_ref, e_col)
    d = d_act_ref[...].astype(f32)
    gc = jnp.minimum(g, limit)
    uc = jnp.minimum(jnp.maximum(u, -limit), limit)
    s = jax.nn.sigmoid(alpha * gc)
    # min and max pass half the gradient at a tie, as autodiff of the reference does
    d_g = d * (uc + 1.0) * (s + gc * alpha * s * (1.0 - s)) * _below(g, limit)
    d_u = d * gc * s * _below(-limit, u) * _below(u, limit)
    d_g, d_u = d_g.astype(d_gate_ref.dtype), d_u.astype(d_up_ref.dtype)
    d_gate_ref[...] = d_g
    d_up_ref[...] = d_u

    # the biases' sums: a one-hot [E, ROWS] product of the rounded gradients; rows of no
    # expert here (E) are zeroed first, since their gradient may be NaN (0 x NaN is NaN)
    num_experts = bg_ref.shape[0]
    one_hot = jax.lax.broadcasted_iota(jnp.int32, (num_experts, e_row_ref.shape[1]), 0)
    one_hot = (one_hot == e_row_ref[...]).astype(d_g.dtype)
    here = e_col < num_experts
    zero = jnp.zeros((), d_g.dtype)
    d_bg_ref[...] += jnp.dot(one_hot, jnp.where(here, d_g, zero), preferred_element_type=f32)
    d_bu_ref[...] += jnp.dot(one_hot, jnp.where(here, d_u, zero), preferred_element_type=f32)


def _row_bias(bias_ref, e_col):
    """Each row's expert's bias [ROWS, F] by selects (a row of no expert gets the first)."""
    out = jnp.broadcast_to(bias_ref[0:1, :], (e_col.shape[0], bias_ref.shape[1]))
    for e in range(1, bias_ref.shape[0]):
        out = jnp.where(e_col == e, bias_ref[e : e + 1, :], out)
    return out


def _below(x, hi):
    """d min(x, hi) / dx: 1 below, 1/2 at, 0 above."""
    return jnp.where(x < hi, 1.0, jnp.where(x == hi, 0.5, 0.0))
