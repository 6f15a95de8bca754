"""The grouped matmul as CPU custom calls (grouped_matmul.cc) on CPUs with AVX512-BF16
dot-product instructions, forward and backward: bfloat16 rows times float32 or bfloat16
group matrices, each read in place from its stack (a `LayerView`'s or `TrainingView`'s
layer, or a plain [G, K, N] array), float32 results: the `grouped_matmul` op's `cpu`
implementation; matmul.py and cross_entropy.py use its products too. Figures in
docs/PERFORMANCE.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train.arrays.layer_views import LayerView, TrainingView, stack_of
from gpt_oss_train.kernels.cpu import build, one_device

TARGET = "gpt_oss_grouped_matmul"
WEIGHT_GRAD_TARGET = "gpt_oss_grouped_matmul_weight_grad"
CPU_FLAG = "avx512_bf16"  # the kernels' instruction, vdpbf16ps
MATRIX_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # rounded to bf16 as read


HANDLERS = (
    (TARGET, "GptOssGroupedMatmul"),
    (WEIGHT_GRAD_TARGET, "GptOssGroupedMatmulWeightGrad"),
)


def unavailable(platform: str = "cpu") -> str | None:
    return build.unavailable("grouped_matmul.cc", HANDLERS, CPU_FLAG)


def accepts(x, w, group_sizes=None, out_dtype=None) -> bool:
    """One device, bfloat16 rows, float32 or bfloat16 matrices (an array or a view of a
    stack; not an int8 QArray or MXFP4Array) of even sides."""
    stack = stack_of(w)
    return (
        x.dtype == jnp.bfloat16
        and isinstance(stack, jax.Array)
        and stack.dtype in MATRIX_DTYPES
        and stack.shape[-1] % 2 == 0
        and stack.shape[-2] % 2 == 0
        and one_device()
    )


def reads_in_place(dtype, stack) -> bool:
    """Whether a model computing in `dtype` should hand this expert stack [layers, E, K, N]
    to the kernel as TrainingViews in training (read in place, no per-layer copy)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and accepts(jnp.zeros((0, 2), jnp.bfloat16), stack)


def grouped_matmul(x_mk, w, group_sizes, out_dtype=None):
    """x [M, K] @ w[g] for each group's rows -> float32 [M, N] (or `out_dtype`; rows past
    the groups are zeros); w a [G, K, N] array (differentiable), a LayerView of such
    layers or a TrainingView (read in place, differentiable in its value)."""
    build.require("grouped_matmul.cc", HANDLERS, CPU_FLAG)
    sizes = group_sizes.astype(jnp.int32)
    if isinstance(w, LayerView):  # inference: no gradient
        y = _product(x_mk, w.stack, w.layer, sizes, transpose=False)
    elif isinstance(w, TrainingView):
        y = _in_place(x_mk, w.value, w.stack, w.layer, sizes)
    else:
        y = _in_place(x_mk, w, w[None], jnp.int32(0), sizes)
    return y if out_dtype is None else y.astype(out_dtype)


def matmul(x, w, *, transpose: bool = False):
    """x [M, K] @ w [K, N] (transpose: x [M, N] @ w^T) -> float32, all rows one group; no
    gradient (for callers with their own backward: cross_entropy.py)."""
    return _product(x, w[None, None], 0, _one_group(x), transpose=transpose)


def weight_grad(x, dy):
    """x [M, K]^T @ dy [M, N] -> float32 [K, N]; no gradient."""
    call = jax.ffi.ffi_call(
        WEIGHT_GRAD_TARGET, jax.ShapeDtypeStruct((1, x.shape[1], dy.shape[1]), jnp.float32)
    )
    return call(x, dy, _one_group(x))[0]


def _one_group(x):
    return jnp.full((1,), x.shape[0], jnp.int32)


def _product(x, stack, layer, sizes, *, transpose: bool):
    """x @ stack[layer, g] (transpose: stack[layer, g]^T) per group."""
    k, n = stack.shape[2:]
    out = jax.ShapeDtypeStruct((x.shape[0], k if transpose else n), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out)
    return call(x, stack, sizes, jnp.asarray(layer, jnp.int32), transpose=np.int64(transpose))


@jax.custom_vjp
def _in_place(x, value, stack, layer, sizes):
    """x @ stack[layer, g] per group, differentiable in x and `value` (stack[layer]'s
    stand-in for the gradient: never read, so a slice that made it is dropped)."""
    return _product(x, stack, layer, sizes, transpose=False)


def _fwd(x, value, stack, layer, sizes):
    return _in_place(x, value, stack, layer, sizes), (x, stack, layer, sizes)


def _bwd(res, dy):
    """dx = dy @ w[g]^T (dy rounded to bfloat16, as the tiled backward does), dW[g] =
    x_g^T @ dy_g."""
    x, stack, layer, sizes = res
    dy = dy.astype(jnp.bfloat16)
    dx = _product(dy, stack, layer, sizes, transpose=True)
    call = jax.ffi.ffi_call(WEIGHT_GRAD_TARGET, jax.ShapeDtypeStruct(stack.shape[1:], jnp.float32))
    dw = call(x, dy, sizes)
    return dx.astype(x.dtype), dw.astype(stack.dtype), None, None, None


_in_place.defvjp(_fwd, _bwd)
