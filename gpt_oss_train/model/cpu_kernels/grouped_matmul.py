"""The grouped matmul as CPU custom calls (grouped_matmul.cc) on CPUs with AVX512-BF16
dot-product instructions, forward and backward: bfloat16 rows times float32 or bfloat16
group matrices, each read in place from its stack (a `LayerView`'s layer, or a plain
[G, K, N] array), float32 results. Prefill and training take it where it applies
(model/grouped_matmul.py); figures in docs/PERFORMANCE.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train import runtime, sharding
from gpt_oss_train.model import streamed_weights
from gpt_oss_train.model.cpu_kernels import build

TARGET = "gpt_oss_grouped_matmul"
WEIGHT_GRAD_TARGET = "gpt_oss_grouped_matmul_weight_grad"
CPU_FLAG = "avx512_bf16"  # the kernels' instruction, vdpbf16ps
MATRIX_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # rounded to bf16 as read


def available() -> bool:
    return CPU_FLAG in runtime.cpu_flags() and build.load(
        "grouped_matmul.cc",
        ((TARGET, "GptOssGroupedMatmul"), (WEIGHT_GRAD_TARGET, "GptOssGroupedMatmulWeightGrad")),
    )


def applies(x, w) -> bool:
    """CPU with AVX512-BF16, one device, bfloat16 rows, float32 or bfloat16 matrices (an
    array or a view of a stack; not an int8 QArray or MXFP4Array) of even sides."""
    stack = w.stack if isinstance(w, streamed_weights.LayerView) else w
    ctx = sharding.active()
    return (
        x.dtype == jnp.bfloat16
        and isinstance(stack, jax.Array)
        and stack.dtype in MATRIX_DTYPES
        and stack.shape[-1] % 2 == 0
        and stack.shape[-2] % 2 == 0
        and sharding.platform() == "cpu"
        and (ctx is None or ctx[0].size == 1)
        and available()
    )


def grouped_matmul(x_mk, w, group_sizes):
    """x [M, K] @ w[g] for each group's rows -> float32 [M, N] (rows past the groups are
    zeros); w a [G, K, N] array (differentiable) or a LayerView of such layers."""
    if not available():
        raise RuntimeError(f"the CPU kernel {TARGET} could not be built (see the log)")
    sizes = group_sizes.astype(jnp.int32)
    if isinstance(w, streamed_weights.LayerView):  # inference: no gradient
        return _product(x_mk, w.stack, w.layer, sizes, transpose=False)
    return _differentiable(x_mk, w, sizes)


def _product(x, stack, layer, sizes, *, transpose: bool):
    """x @ stack[layer, g] (transpose: stack[layer, g]^T) per group."""
    k, n = stack.shape[2:]
    out = jax.ShapeDtypeStruct((x.shape[0], k if transpose else n), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out)
    return call(x, stack, sizes, jnp.asarray(layer, jnp.int32), transpose=np.int64(transpose))


@jax.custom_vjp
def _differentiable(x, w, sizes):
    return _product(x, w[None], 0, sizes, transpose=False)


def _fwd(x, w, sizes):
    return _differentiable(x, w, sizes), (x, w, sizes)


def _bwd(res, dy):
    """dx = dy @ w[g]^T (dy rounded to bfloat16, as the tiled backward does), dW[g] =
    x_g^T @ dy_g."""
    x, w, sizes = res
    dy = dy.astype(jnp.bfloat16)
    dx = _product(dy, w[None], 0, sizes, transpose=True)
    call = jax.ffi.ffi_call(WEIGHT_GRAD_TARGET, jax.ShapeDtypeStruct(w.shape, jnp.float32))
    dw = call(x, dy, sizes)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_differentiable.defvjp(_fwd, _bwd)
