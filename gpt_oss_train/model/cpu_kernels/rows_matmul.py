"""A few rows times a large float32 matrix as one CPU custom call (rows_matmul.cc): the
decode step's unembedding, where XLA:CPU's dot at 2-16 rows reads the [D, vocab] matrix
at a fraction of the memory bandwidth. Differentiable (the backward is XLA's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt_oss_train import sharding
from gpt_oss_train.model.cpu_kernels import build

TARGET = "gpt_oss_rows_matmul_f32"
# From 2 to 16 rows the kernel is 1.3-2.4x faster than XLA's dot at the benchmark's
# [768, 32768] unembedding; XLA's dot is faster at one row (docs/PERFORMANCE.md).
MIN_ROWS, MAX_ROWS = 2, 16


def available() -> bool:
    return build.load("rows_matmul.cc", ((TARGET, "GptOssRowsMatmulF32"),))


def applies(rows: int, w, dtype) -> bool:
    """CPU, one device, float32, a few rows."""
    ctx = sharding.active()
    return (
        MIN_ROWS <= rows <= MAX_ROWS
        and jnp.dtype(dtype) == jnp.float32
        and isinstance(w, jax.Array)  # not an int8 QArray
        and w.dtype == jnp.float32
        and sharding.platform() == "cpu"
        and (ctx is None or ctx[0].size == 1)
        and available()
    )


@jax.custom_vjp
def rows_matmul(x_mk, w_kn):
    """x [M, K] @ w [K, N] -> float32 [M, N]."""
    if not available():
        raise RuntimeError(f"the CPU kernel {TARGET} could not be built (see the log)")
    m, n = x_mk.shape[0], w_kn.shape[1]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x_mk.astype(jnp.float32), w_kn.astype(jnp.float32))


def _fwd(x_mk, w_kn):
    return rows_matmul(x_mk, w_kn), (x_mk, w_kn)


def _bwd(res, dy_mn):
    x_mk, w_kn = res
    return (dy_mn @ w_kn.T).astype(x_mk.dtype), (x_mk.T @ dy_mn).astype(w_kn.dtype)


rows_matmul.defvjp(_fwd, _bwd)
