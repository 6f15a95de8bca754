"""The AVX512-BF16 grouped matmul kernels (kernels/cpu/grouped_matmul.cc) against
numpy in float64: the forward, the transposed product the backward's dx uses and the
per-group weight gradient, on groupings that reach every branch of their bookkeeping
(empty groups first, in the middle and last; one group holding every row; odd group
sizes, whose last row pairs with zeros; fewer rows in groups than in the array), sides
that are not multiples of a vector or a panel, float32 and bfloat16 matrices, and a layer
read in place from a stack. The reference takes the bfloat16-rounded operands the kernel
multiplies, so only float32 accumulation separates them."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import ROOT

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.arrays.layer_views import LayerView
from gpt_oss_train.kernels import Kernels
from gpt_oss_train.model.transformer import ModelDef


@pytest.fixture
def kernel(cpu_kernel):
    """kernels/cpu/grouped_matmul.py, built (skips where this CPU or machine cannot:
    AVX512-BF16 and a C++ compiler)."""
    return cpu_kernel("grouped_matmul")


# (group sizes, rows, K, N)
CASES = [
    ([0, 17, 3, 0, 20, 0], 40, 8, 6),
    ([40, 0, 0], 40, 32, 48),
    ([1, 1, 1, 1, 1, 35], 45, 70, 130),  # 5 rows past the groups
    ([5, 0, 9, 0, 0, 0], 40, 16, 18),
    ([0, 0, 0], 12, 4, 4),
    ([100, 157, 3], 260, 96, 200),  # several panels and register blocks per group
    ([30, 0, 51], 81, 40, 128),  # full panels on 64-byte rows: dW's streamed stores
]


def _bf16(a):
    """a rounded to bfloat16, in float64."""
    return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)


def _reference(x, w, sizes, dy):
    """y = x @ w[g], dx = dy @ w[g]^T and dW[g] = x_g^T dy_g per group, float64."""
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g, n in enumerate(sizes):
        rows = slice(start, start + n)
        y[rows], dx[rows], dw[g] = x[rows] @ w[g], dy[rows] @ w[g].T, x[rows].T @ dy[rows]
        start += n
    return y, dx, dw


def _close(got, want):
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(np.abs(want).max(), 1))


@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes,rows,k,n", CASES)
def test_products_equal_float64(sizes, rows, k, n, wdtype, kernel):
    rng = np.random.RandomState(rows + k + n)
    x, w, dy = rng.randn(rows, k), rng.randn(len(sizes), k, n), rng.randn(rows, n)
    xb, dyb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    wj, gs = jnp.asarray(w, wdtype), jnp.array(sizes, jnp.int32)
    y, dx, dw = _reference(_bf16(x), _bf16(w), sizes, _bf16(dy))  # f32 w: rounded as read
    _close(kernel._product(xb, wj[None], 0, gs, transpose=False), y)
    _close(kernel._product(dyb, wj[None], 0, gs, transpose=True), dx)
    grad = jax.ffi.ffi_call(kernel.WEIGHT_GRAD_TARGET, jax.ShapeDtypeStruct(w.shape, jnp.float32))
    _close(grad(xb, dyb, gs), dw)


def test_a_layer_of_a_stack_is_read_in_place(kernel):
    rng = np.random.RandomState(0)
    sizes, x = [3, 0, 6, 1], rng.randn(12, 24)
    stack = rng.randn(3, len(sizes), 24, 40)
    view = LayerView(jnp.asarray(stack, jnp.bfloat16), jnp.asarray(2, jnp.int32))
    got = jax.jit(kernel.grouped_matmul)(jnp.asarray(x, jnp.bfloat16), view, jnp.array(sizes))
    want, _, _ = _reference(_bf16(x), _bf16(stack[2]), sizes, np.zeros((12, 40)))
    _close(got, want)


def test_training_takes_the_kernels_and_their_gradients_match(kernel):
    """bfloat16 rows take the kernels (float32 master weights too), forward and backward;
    dx comes back in x's dtype and dW in w's, as the tiled kernel returns them."""
    rng = np.random.RandomState(1)
    sizes, x, w, dy = [0, 17, 3, 0, 20, 0], rng.randn(40, 8), rng.randn(6, 8, 6), rng.randn(40, 6)
    xb, wj, gs = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.float32), jnp.array(sizes)
    impl = Kernels().impl("grouped_matmul")
    assert impl.name == "cpu"
    assert impl.takes(xb, wj, gs)
    assert not impl.takes(xb.astype(jnp.float32), wj, gs)  # float32 rows: the tiled reference
    f = lambda x, w: Kernels().grouped_matmul(x, w, gs)
    text = jax.jit(jax.vjp(f, xb, wj)[1]).lower(jnp.asarray(dy, jnp.float32)).as_text()
    assert kernel.TARGET in text and kernel.WEIGHT_GRAD_TARGET in text
    y, vjp = jax.vjp(f, xb, wj)
    dx, dw = vjp(jnp.asarray(dy, jnp.float32))
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)
    want = _reference(_bf16(x), _bf16(w), sizes, _bf16(dy))
    _close(y, want[0])
    np.testing.assert_allclose(np.asarray(dx, np.float64), want[1], rtol=1e-2, atol=1e-2)
    _close(dw, want[2])


def test_a_mesh_of_several_devices_keeps_the_tiled_kernel(kernel):
    """Under a mesh of several devices the kernel declines (XLA would gather a custom
    call's operands onto every device) and the tiled reference computes the product."""
    x = jnp.ones((6, 8), jnp.bfloat16)
    w = jnp.arange(1, 4, dtype=jnp.bfloat16)[:, None, None] * jnp.ones((3, 8, 4), jnp.bfloat16)
    sizes = jnp.array([2, 0, 3], jnp.int32)  # group 1 empty, row 5 past the groups
    run = jax.jit(lambda x, w: Kernels().grouped_matmul(x, w, sizes))
    assert kernel.accepts(x, w, sizes) and kernel.TARGET in run.lower(x, w).as_text()
    mesh = sharding.make_mesh(dict(data=1, fsdp=4, tensor=1, expert=2))
    with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
        assert not kernel.accepts(x, w, sizes)
        assert kernel.TARGET not in run.lower(x, w).as_text()
        y = run(x, w)
    want = np.repeat([[8.0], [24.0], [0.0]], [2, 3, 1], axis=0) * np.ones(4)  # 8 * (g + 1)
    np.testing.assert_array_equal(np.asarray(y), want)


@pytest.mark.full
def test_training_reads_expert_stacks_in_place_with_the_same_gradients(monkeypatch, kernel):
    """A bfloat16 model's training step hands the experts TrainingViews: the kernels read
    each layer from its stack, so the compiled step slices no expert layer off (the
    copy XLA made per layer), and the gradients are those of the plain slices, bit for
    bit (the same kernel products, summed the same way)."""
    c = config_lib.default_config()
    c.dtype = "bfloat16"
    c.model.update(
        vocab_size=256,
        hidden_size=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=4,
        experts_per_token=2,
        intermediate_size=48,
        sliding_window=8,
    )
    mc = config_lib.ModelConfig.from_config(c)
    md = ModelDef(mc)
    params = md.init(0)
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, mc.vocab_size)

    def loss(p):
        model = md.bind(p)
        h, aux, _ = model(tokens)
        return jnp.mean(model.logits(h).astype(jnp.float32) ** 2) + aux

    def expert_slices(step):  # layers sliced off the [2, 4, 32, 48] wi_gate/wi_up stacks
        hlo = step.lower(params).compile().as_text()
        assert "gpt_oss_grouped_matmul" in hlo
        return len(re.findall(r"f32\[1,4,32,48\]\S* dynamic-slice\(", hlo))

    step = jax.jit(jax.grad(loss))
    assert expert_slices(step) == 0
    in_place = step(params)
    monkeypatch.setattr(kernel, "reads_in_place", lambda dtype, stack: False)
    step = jax.jit(jax.grad(loss))
    assert expert_slices(step) > 0
    for a, b in zip(jax.tree.leaves(in_place), jax.tree.leaves(step(params))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Runs in a process started with AddressSanitizer's runtime preloaded: the kernel library
# is built instrumented, and every CASE's three products must touch nothing outside their
# operands and the kernel's own buffers.
_SANITIZED = """
import sys

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train.kernels.cpu import build

build.FLAGS = [*build.FLAGS, "-fsanitize=address", "-fno-omit-frame-pointer"]
from gpt_oss_train.kernels.cpu import grouped_matmul as kernel

assert kernel.unavailable() is None, kernel.unavailable()
for sizes, rows, k, n in CASES:
    rng = np.random.RandomState(rows + k + n)
    x = jnp.asarray(rng.randn(rows, k), jnp.bfloat16)
    dy = jnp.asarray(rng.randn(rows, n), jnp.bfloat16)
    w, gs = jnp.asarray(rng.randn(len(sizes), k, n), jnp.float32), jnp.array(sizes, jnp.int32)
    kernel._product(x, w[None], 0, gs, transpose=False).block_until_ready()
    kernel._product(dy, w[None], 0, gs, transpose=True).block_until_ready()
    out = jax.ShapeDtypeStruct(w.shape, jnp.float32)
    jax.ffi.ffi_call(kernel.WEIGHT_GRAD_TARGET, out)(x, dy, gs).block_until_ready()
print("clean")
"""


def _runtime_library(name: str) -> str | None:
    """The compiler's copy of a runtime library (`g++ -print-file-name`), or None."""
    try:
        path = subprocess.run(
            ["g++", f"-print-file-name={name}"], capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.full
def test_the_products_read_and_write_only_their_buffers(kernel, tmp_path):
    """Under AddressSanitizer. The weight gradient read a whole panel of its packed dy
    past the last row pair when N's last panel was partial (N < 64 or N % 64 != 0): a
    heap over-read that faulted only where the buffer ended a page below unmapped memory,
    the rare segmentation fault of CPU training steps (one run in about eight of a
    checkpoint-every-step CLI loop); the sanitizer reports it every time."""
    asan, cxx_runtime = _runtime_library("libasan.so"), _runtime_library("libstdc++.so.6")
    if asan is None or cxx_runtime is None:
        pytest.skip("no AddressSanitizer runtime (libasan) beside g++")
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="",
        XDG_CACHE_HOME=str(tmp_path),  # the instrumented build stays out of the user's cache
        # libstdc++ first too: ASan's exception interceptor needs it loaded
        LD_PRELOAD=f"{asan} {cxx_runtime}",
        ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0",
    )
    code = f"CASES = {CASES!r}\n{_SANITIZED}"
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and "clean" in r.stdout, r.stderr[-6000:]
    assert "AddressSanitizer" not in r.stderr, r.stderr[-6000:]
