"""A few rows times a large float32 or bfloat16 matrix as one CPU custom call
(rows_matmul.cc), with float32 results: a decode step's unembedding and attention
projections, where XLA:CPU's dot at 2-16 rows reads the matrix at a fraction of the
memory bandwidth. The matrix may be a layer of a stacked parameter (a `LayerView`,
arrays/layer_views.py), read in place. For plain arrays it is differentiable (the
backward is XLA's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt_oss_train.arrays.layer_views import LayerView
from gpt_oss_train.kernels.cpu import DTYPES, build, one_device

TARGET = "gpt_oss_rows_matmul"
# Up to 16 rows the kernel is faster than XLA's dot at the benchmark's [768, 32768]
# unembedding (at one row, as fast in float32 and 2.8x faster on bfloat16 weights, which
# XLA converts first), and a layer view costs XLA a copy of the layer (docs/PERFORMANCE.md).
MAX_ROWS = 16


HANDLERS = ((TARGET, "GptOssRowsMatmul"),)


def unavailable(platform: str = "cpu") -> str | None:
    return build.unavailable("rows_matmul.cc", HANDLERS)


def accepts(rows: int, w, dtype) -> bool:
    """One device, float32 or bfloat16 compute and weights (an array, or a view of a
    stack, of either), a few rows."""
    stack = w.stack if isinstance(w, LayerView) else w
    return (
        rows <= MAX_ROWS
        and jnp.dtype(dtype) in DTYPES
        and isinstance(stack, jax.Array)  # not an int8 QArray or MXFP4Array
        and stack.dtype in DTYPES
        and one_device()
    )


def _call(x_mk, stack_lkn, layer):
    build.require("rows_matmul.cc", HANDLERS)
    m, n = x_mk.shape[0], stack_lkn.shape[2]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x_mk.astype(jnp.float32), stack_lkn, jnp.asarray(layer, jnp.int32))


def rows_matmul(x_mk, w):
    """x [M, K] @ w -> float32 [M, N]: w a [K, ...] array or a LayerView of such layers,
    its leading dimensions (product K) contracted with x, the rest (product N) kept."""
    if isinstance(w, LayerView):
        k = x_mk.shape[1]
        stack = w.stack.reshape(w.stack.shape[0], k, -1)  # a bitcast: the layout is row-major
        return _call(x_mk, stack, w.layer)
    return _array_matmul(x_mk, w.reshape(x_mk.shape[1], -1))


@jax.custom_vjp
def _array_matmul(x_mk, w_kn):
    return _call(x_mk, w_kn[None], 0)


def _fwd(x_mk, w_kn):
    return _array_matmul(x_mk, w_kn), (x_mk, w_kn)


def _bwd(res, dy_mn):
    x_mk, w_kn = res
    return (dy_mn @ w_kn.T).astype(x_mk.dtype), (x_mk.T @ dy_mn).astype(w_kn.dtype)


_array_matmul.defvjp(_fwd, _bwd)
