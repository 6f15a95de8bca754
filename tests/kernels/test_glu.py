"""The experts' gated activation kernels against numpy in float64: the CPU's
(kernels/cpu/glu.cc), the bfloat16 activation and the gradients of gate, up and both
biases (the per-expert sums) by the hand-derived formulas, on rows of unsorted experts,
an expert with no rows, widths that are not a multiple of a vector, and values exactly
at the limits (where min and clip pass half the gradient, as autodiff does); the TPU's
backward kernel (kernels/tpu/glu.py, in Pallas' interpreter) the same way, with rows of
no expert whose cotangent is NaN; and the MoE layer taking the CPU kernel (model/moe.py,
through the kernel registry) against the XLA activation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train.kernels import Kernels
from gpt_oss_train.kernels.tpu import glu
from gpt_oss_train.kernels.xla import experts as xla_experts
from gpt_oss_train.model import moe

LIMIT, ALPHA = 7.0, 1.702


@pytest.fixture
def kernel(cpu_kernel):
    """kernels/cpu/glu.py, built (skips where this CPU or machine cannot: AVX512-BF16 and
    a C++ compiler)."""
    return cpu_kernel("glu")


def _step(x, hi):
    """d min(x, hi) / dx: 1 below, 1/2 at, 0 above."""
    return np.where(x < hi, 1.0, np.where(x == hi, 0.5, 0.0))


@pytest.mark.parametrize("rows,width,experts", [(37, 21, 5), (64, 48, 3), (1, 1, 1)])
def test_glu_and_gradients_match_float64(rows, width, experts, kernel):
    rng = np.random.default_rng(rows + width)
    gate = (rng.standard_normal((rows, width)) * 5).astype(np.float32)
    up = (rng.standard_normal((rows, width)) * 5).astype(np.float32)
    bg = rng.standard_normal((experts, width)).astype(np.float32)
    bu = rng.standard_normal((experts, width)).astype(np.float32)
    e = rng.integers(0, max(1, experts - 1), rows).astype(np.int32)  # the last: no rows
    bg[:, 0], bu[:, 0] = 0.0, 0.0  # column 0: values exactly at the limits
    gate[::3, 0], up[1::3, 0], up[2::3, 0] = LIMIT, LIMIT, -LIMIT
    dact = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)

    act, vjp = jax.vjp(
        lambda *a: kernel.gated_activation(
            *a, jnp.asarray(e), limit=LIMIT, alpha=ALPHA, dtype=jnp.bfloat16
        ),
        gate,
        up,
        bg,
        bu,
    )
    dgate, dup, dbg, dbu = vjp(dact)

    g = gate.astype(np.float64) + bg[e]
    u = up.astype(np.float64) + bu[e]
    gc, uc = np.minimum(g, LIMIT), np.clip(u, -LIMIT, LIMIT)
    s = 1.0 / (1.0 + np.exp(-ALPHA * gc))
    ref_act = gc * s * (uc + 1.0)
    assert act.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(act, np.float64), ref_act, rtol=2**-8, atol=1e-6)

    ref_dgate, ref_dup = _float64_gradients(g, u, np.asarray(dact, np.float64))
    scale = lambda a: 1e-5 * max(1.0, np.abs(a).max())
    np.testing.assert_allclose(dgate, ref_dgate, atol=scale(ref_dgate))
    np.testing.assert_allclose(dup, ref_dup, atol=scale(ref_dup))
    ref_dbg, ref_dbu = _by_expert(ref_dgate, e, experts), _by_expert(ref_dup, e, experts)
    np.testing.assert_allclose(dbg, ref_dbg, atol=scale(ref_dbg))
    np.testing.assert_allclose(dbu, ref_dbu, atol=scale(ref_dbu))


def _float64_gradients(g, u, d):
    """The gradients of the biased gate g and up u, given the activation's cotangent d."""
    gc, uc = np.minimum(g, LIMIT), np.clip(u, -LIMIT, LIMIT)
    s = 1.0 / (1.0 + np.exp(-ALPHA * gc))
    dgate = d * (uc + 1.0) * (s + gc * ALPHA * s * (1.0 - s)) * _step(g, LIMIT)
    return dgate, d * gc * s * _step(-LIMIT, u) * _step(u, LIMIT)


def _by_expert(rows, e, experts):
    out = np.zeros((experts, rows.shape[1]))
    np.add.at(out, e, rows)
    return out


def test_tpu_backward_kernel_matches_float64():
    """kernels/tpu/glu.py's backward in Pallas' interpreter, on bf16 rows as the TPU step
    has them: both gradients within a bf16 rounding of float64's (the kernel computes in
    float32 and rounds once), the biases' sums of those rounded gradients, rows of no
    expert (E, a NaN cotangent there) left out of the sums; a 200-wide F (not whole
    128-lane vectors), an expert with no rows, values at the limits. Through the op, the
    forward is XLA's activation, bit for bit."""
    rng = np.random.default_rng(7)
    rows, width, experts = 512, 200, 6
    e = np.sort(rng.integers(0, experts, rows)).astype(np.int32)
    e[e == 2] = 3  # expert 2: no rows
    e[-40:] = experts  # rows past the groups: no expert here
    gate = (rng.standard_normal((rows, width)) * 5).astype(jnp.bfloat16)
    up = (rng.standard_normal((rows, width)) * 5).astype(jnp.bfloat16)
    gate[::3, 0], up[1::3, 0], up[2::3, 0] = LIMIT, LIMIT, -LIMIT
    bg = rng.standard_normal((experts, width)).astype(np.float32)
    bu = rng.standard_normal((experts, width)).astype(np.float32)
    bg[:, 0], bu[:, 0] = 0.0, 0.0  # column 0: values exactly at the limits
    dact = rng.standard_normal((rows, width)).astype(jnp.bfloat16)
    dact[-40:] = np.nan
    glu_args = dict(limit=LIMIT, alpha=ALPHA, dtype=jnp.bfloat16)
    assert glu.accepts(jnp.asarray(gate), jnp.asarray(up), bg, bu, jnp.asarray(e), **glu_args)

    run = lambda fn: jax.vjp(lambda *a: fn(*a, jnp.asarray(e), **glu_args), gate, up, bg, bu)
    (act, pull), (ref_act, _) = run(glu.gated_activation), run(xla_experts.gated_activation)
    np.testing.assert_array_equal(act, ref_act)
    dgate, dup, dbg, dbu = pull(jnp.asarray(dact))
    assert dgate.dtype == dup.dtype == jnp.bfloat16 and dbg.dtype == jnp.float32

    held = e < experts
    g = gate.astype(np.float64) + bg[np.minimum(e, experts - 1)]
    u = up.astype(np.float64) + bu[np.minimum(e, experts - 1)]
    ref_dgate, ref_dup = _float64_gradients(g, u, dact.astype(np.float64))
    for got, want in ((dgate, ref_dgate), (dup, ref_dup)):
        got = np.asarray(got, np.float64)[held]
        np.testing.assert_allclose(got, want[held], rtol=2**-8, atol=1e-6)
    rounded = lambda a: np.asarray(a, np.float64)[held]  # the sums take the bf16 gradients
    for got, grads in ((dbg, dgate), (dbu, dup)):
        want = _by_expert(rounded(grads), e[held], experts)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-4)
        assert np.all(np.asarray(got)[2] == 0)


def test_bfloat16_biases_are_widened_and_get_bfloat16_gradients(kernel):
    """Inference's bfloat16 biases: the same activation as their float32 values give, and
    gradients in their dtype."""
    rng = np.random.default_rng(1)
    gate, up = (rng.standard_normal((10, 16)).astype(np.float32) for _ in range(2))
    bg, bu = (jnp.asarray(rng.standard_normal((3, 16)), jnp.bfloat16) for _ in range(2))
    e = jnp.asarray(rng.integers(0, 3, 10), jnp.int32)
    glu = dict(limit=LIMIT, alpha=ALPHA, dtype=jnp.bfloat16)
    run = lambda bg, bu: kernel.gated_activation(gate, up, bg, bu, e, **glu)
    assert kernel.accepts(jnp.asarray(gate), jnp.asarray(up), bg, bu, e, **glu)
    np.testing.assert_array_equal(run(bg, bu), run(bg.astype(jnp.float32), bu.astype(jnp.float32)))
    dbg, dbu = jax.grad(lambda bg, bu: jnp.sum(run(bg, bu).astype(jnp.float32)), (0, 1))(bg, bu)
    assert dbg.dtype == dbu.dtype == jnp.bfloat16


def test_moe_layer_takes_the_kernel_and_matches_xla(kernel):
    """grouped_experts in bfloat16 (the kernel) against the same layer with the
    activation's reference chosen (Kernels.of(gated_activation="xla"), XLA's activation,
    the other kernels as they were): outputs and gradients of x and every expert weight."""
    assert Kernels().impl("gated_activation").name == "cpu"
    xla = Kernels.of(gated_activation="xla")
    rng = np.random.default_rng(0)
    t, d, f, n, k = 24, 32, 48, 6, 2
    w = moe.ExpertWeights(
        *(
            jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
            for s in [(n, d, f), (n, f), (n, d, f), (n, f), (n, f, d), (n, d)]
        )
    )
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    weights, idx, _ = moe.route(x, jnp.asarray(rng.standard_normal((d, n))), jnp.zeros(n), k)

    def loss(x, w, kernels=Kernels()):
        y = moe.grouped_experts(
            x, weights, idx, w, limit=LIMIT, alpha=ALPHA, dtype=jnp.bfloat16, kernels=kernels
        )
        return jnp.sum(y * jnp.cos(y))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    assert kernel.GRAD_TARGET in grad.lower(x, w).as_text()
    value, (dx, dw) = grad(x, w)
    ref_grad = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, xla), argnums=(0, 1)))
    assert kernel.TARGET not in ref_grad.lower(x, w).as_text()
    ref_value, (ref_dx, ref_dw) = ref_grad(x, w)
    np.testing.assert_allclose(value, ref_value, rtol=1e-2)
    for a, b in zip([dx, *dw[:6]], [ref_dx, *ref_dw[:6]]):
        np.testing.assert_allclose(a, b, atol=2e-2 * np.abs(b).max())
