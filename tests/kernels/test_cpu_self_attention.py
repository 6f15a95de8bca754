"""The CPU self-attention kernel (kernels/cpu/self_attention.cc) against attention
written out in numpy float64: outputs and the gradients of q, k, v and the sinks, on
sequences that are not multiples of its 64-query blocks, causal and banded layers, packed
rows (two segments), padding queries and keys (position -1), a query that sees nothing
but its sink, several query heads per KV head, float32 and bfloat16 operands. Then the
dispatch: the registry's `attention` op takes it on one CPU device and keeps XLA's
attention under a mesh of several devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.kernels import Kernels


@pytest.fixture
def kernel(cpu_kernel):
    """kernels/cpu/self_attention.py, built (skips where this CPU or machine cannot:
    AVX-512 and a C++ compiler)."""
    return cpu_kernel("self_attention")


def _reference(q, k, v, sinks, pos, seg, window, dout):
    """Forward and gradients in float64, written out from the definition (the module
    docstring of kernels/xla/attention.py)."""
    b, s, n, h = q.shape
    g = n // k.shape[2]
    out, dq, dk, dv, dsinks = (
        np.zeros_like(q),
        np.zeros_like(q),
        np.zeros_like(k),
        np.zeros_like(v),
        np.zeros(n),
    )
    for r in range(b):
        qp, kp = pos[r][:, None], pos[r][None, :]
        vis = (kp >= 0) & (kp <= qp) & (seg[r][:, None] == seg[r][None, :])
        if window:
            vis &= qp - kp < window
        for head in range(n):
            kv = head // g
            logits = np.where(vis, q[r, :, head] @ k[r, :, kv].T / np.sqrt(h), -np.inf)
            top = np.maximum(logits.max(-1), sinks[head])[:, None]
            e = np.exp(logits - top)
            denom = e.sum(-1, keepdims=True) + np.exp(sinks[head] - top)
            p = e / denom
            out[r, :, head] = p @ v[r, :, kv]
            do = dout[r, :, head]
            dp = do @ v[r, :, kv].T
            d_row = (do * out[r, :, head]).sum(-1, keepdims=True)
            ds = p * (dp - d_row)
            dq[r, :, head] = ds @ k[r, :, kv] / np.sqrt(h)
            dk[r, :, kv] += ds.T @ q[r, :, head] / np.sqrt(h)
            dv[r, :, kv] += p.T @ do
            dsinks[head] -= (np.exp(sinks[head] - top)[:, 0] / denom[:, 0] * d_row[:, 0]).sum()
    return out, (dq, dk, dv, dsinks)


def _layout(b, s, kind):
    pos = np.tile(np.arange(s), (b, 1)).astype(np.int32)
    seg = np.ones((b, s), np.int32)
    if kind == "packed":  # row 0: two sequences; row 1: 5 padding slots at the end
        cut = s // 3
        seg[0, cut:], pos[0, cut:] = 2, np.arange(s - cut)
        if b > 1:
            pos[1, -5:], seg[1, -5:] = -1, 0
    return pos, seg


# (b, s, n, kh, h, window, layout)
CASES = [
    (2, 70, 6, 2, 16, None, "packed"),  # a 64-query block and a 6-query one
    (2, 130, 6, 2, 64, 32, "packed"),  # banded: key blocks outside the band are skipped
    (1, 200, 3, 1, 64, None, "plain"),
    (3, 64, 4, 4, 32, 7, "packed"),  # one query head per KV head, a narrow band
    (1, 9, 2, 1, 16, 1, "plain"),  # window 1: each query sees only itself
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("b,s,n,kh,h,window,layout", CASES)
def test_forward_and_gradients_equal_float64(b, s, n, kh, h, window, layout, dtype, kernel):
    rng = np.random.default_rng(s)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), dtype)
        for shape in ((b, s, n, h), (b, s, kh, h), (b, s, kh, h))
    )
    sinks = jnp.asarray(rng.standard_normal(n), jnp.float32)
    dout = jnp.asarray(rng.standard_normal((b, s, n, h)), dtype)
    pos, seg = _layout(b, s, layout)
    if layout == "packed" and b > 1:
        pos[1, 0] = -1  # a padding query first: it sees no key, only its sink -> 0

    def loss(q, k, v, sinks):
        layout = dict(positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))
        out = kernel.self_attention(q, k, v, sinks, **layout, window=window, block=64)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    want_out, want_grads = _reference(*map(f64, (q, k, v, sinks)), pos, seg, window, f64(dout))
    # float32 accumulation: ~1e-6 of the scale; bfloat16 results: their rounding (2^-8)
    tol = 2e-6 if dtype == jnp.float32 else 8e-3
    for got, want in zip((out, *grads), (want_out, *want_grads)):
        assert got.dtype == (dtype if got.ndim > 1 else jnp.float32)
        np.testing.assert_allclose(f64(got), want, rtol=0, atol=tol * max(np.abs(want).max(), 1))
    if layout == "packed" and b > 1:
        assert np.all(f64(out)[1, 0] == 0)


def _attend(q, k, v, sinks, pos, window):
    """The model's call: the `attention` op, "auto" (the CPU kernel on a CPU)."""
    seg = jnp.ones_like(pos)
    return Kernels().attention(q, k, v, sinks, positions=pos, segment_ids=seg, window=window)


def test_attention_takes_the_kernel_on_one_device_and_xla_under_a_mesh(kernel):
    assert Kernels().impl("attention").name == "cpu"
    rng = np.random.default_rng(0)
    b, s, n, kh, h = 8, 40, 4, 2, 16
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((b, s, n, h), (b, s, kh, h), (b, s, kh, h))
    )
    sinks = jnp.asarray(rng.standard_normal(n), jnp.float32)
    pos = jnp.tile(jnp.arange(s, dtype=jnp.int32), (b, 1))
    lowered = jax.jit(lambda *a: _attend(*a, pos, 16)).lower(q, k, v, sinks).as_text()
    assert kernel.TARGET in lowered
    one = jax.jit(lambda *a: _attend(*a, pos, 16))(q, k, v, sinks)
    mesh = sharding.make_mesh(dict(data=8, fsdp=1, tensor=1, expert=1))
    with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
        assert mesh.size > 1 and not kernel.accepts(
            q, k, v, sinks, positions=pos, segment_ids=jnp.ones_like(pos), window=16, block=512
        )
        lowered = jax.jit(lambda *a: _attend(*a, pos, 16)).lower(q, k, v, sinks).as_text()
        assert kernel.TARGET not in lowered
        several = jax.jit(lambda *a: _attend(*a, pos, 16))(q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(one), np.asarray(several), rtol=0, atol=2e-6)
