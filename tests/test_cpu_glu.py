"""The experts' gated activation kernels (model/cpu_kernels/glu.cc) against numpy in
float64: the bfloat16 activation, and the gradients of gate, up and both biases (the
per-expert sums) by the hand-derived formulas, on rows of unsorted experts, an expert
with no rows, widths that are not a multiple of a vector, and values exactly at the
limits (where min and clip pass half the gradient, as autodiff does); and the MoE layer
taking it (model/moe.py) against the XLA activation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train.model import moe
from gpt_oss_train.model.cpu_kernels import glu as kernel

pytestmark = pytest.mark.skipif(
    not kernel.available(), reason="needs a CPU with AVX512-BF16 and a C++ compiler"
)

LIMIT, ALPHA = 7.0, 1.702


def _step(x, hi):
    """d min(x, hi) / dx: 1 below, 1/2 at, 0 above."""
    return np.where(x < hi, 1.0, np.where(x == hi, 0.5, 0.0))


@pytest.mark.parametrize("rows,width,experts", [(37, 21, 5), (64, 48, 3), (1, 1, 1)])
def test_glu_and_gradients_match_float64(rows, width, experts):
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
        lambda *a: kernel.glu(*a, jnp.asarray(e), limit=LIMIT, alpha=ALPHA), gate, up, bg, bu
    )
    dgate, dup, dbg, dbu = vjp(dact)

    g = gate.astype(np.float64) + bg[e]
    u = up.astype(np.float64) + bu[e]
    gc, uc = np.minimum(g, LIMIT), np.clip(u, -LIMIT, LIMIT)
    s = 1.0 / (1.0 + np.exp(-ALPHA * gc))
    ref_act = gc * s * (uc + 1.0)
    assert act.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(act, np.float64), ref_act, rtol=2**-8, atol=1e-6)

    d = np.asarray(dact, np.float64)
    ref_dgate = d * (uc + 1.0) * (s + gc * ALPHA * s * (1.0 - s)) * _step(g, LIMIT)
    ref_dup = d * gc * s * _step(-LIMIT, u) * _step(u, LIMIT)
    scale = lambda a: 1e-5 * max(1.0, np.abs(a).max())
    np.testing.assert_allclose(dgate, ref_dgate, atol=scale(ref_dgate))
    np.testing.assert_allclose(dup, ref_dup, atol=scale(ref_dup))
    ref_dbg, ref_dbu = np.zeros((experts, width)), np.zeros((experts, width))
    np.add.at(ref_dbg, e, ref_dgate)
    np.add.at(ref_dbu, e, ref_dup)
    np.testing.assert_allclose(dbg, ref_dbg, atol=scale(ref_dbg))
    np.testing.assert_allclose(dbu, ref_dbu, atol=scale(ref_dbu))


def test_bfloat16_biases_are_widened_and_get_bfloat16_gradients():
    """Inference's bfloat16 biases: the same activation as their float32 values give, and
    gradients in their dtype."""
    rng = np.random.default_rng(1)
    gate, up = (rng.standard_normal((10, 16)).astype(np.float32) for _ in range(2))
    bg, bu = (jnp.asarray(rng.standard_normal((3, 16)), jnp.bfloat16) for _ in range(2))
    e = jnp.asarray(rng.integers(0, 3, 10), jnp.int32)
    run = lambda bg, bu: kernel.glu(gate, up, bg, bu, e, limit=LIMIT, alpha=ALPHA)
    assert kernel.applies(jnp.asarray(gate), bg, jnp.bfloat16)
    np.testing.assert_array_equal(run(bg, bu), run(bg.astype(jnp.float32), bu.astype(jnp.float32)))
    dbg, dbu = jax.grad(lambda bg, bu: jnp.sum(run(bg, bu).astype(jnp.float32)), (0, 1))(bg, bu)
    assert dbg.dtype == dbu.dtype == jnp.bfloat16


def test_moe_layer_takes_the_kernel_and_matches_xla():
    """grouped_experts in bfloat16 (the kernel) against the same layer with the kernel
    turned off (XLA's activation): outputs and gradients of x and every expert weight."""
    rng = np.random.default_rng(0)
    t, d, f, n, k = 24, 32, 48, 6, 2
    w = moe.ExpertWeights(
        *(jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
          for s in [(n, d, f), (n, f), (n, d, f), (n, f), (n, f, d), (n, d)])
    )  # fmt: skip
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    weights, idx, _ = moe.route(x, jnp.asarray(rng.standard_normal((d, n))), jnp.zeros(n), k)

    def loss(x, w):
        y = moe.grouped_experts(x, weights, idx, w, limit=LIMIT, alpha=ALPHA, dtype=jnp.bfloat16)
        return jnp.sum(y * jnp.cos(y))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    assert kernel.GRAD_TARGET in grad.lower(x, w).as_text()
    value, (dx, dw) = grad(x, w)
    original = kernel.available
    kernel.available = lambda: False
    try:
        ref_value, (ref_dx, ref_dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    finally:
        kernel.available = original
    np.testing.assert_allclose(value, ref_value, rtol=1e-2)
    for a, b in zip([dx, *dw[:6]], [ref_dx, *ref_dw[:6]]):
        np.testing.assert_allclose(a, b, atol=2e-2 * np.abs(b).max())
