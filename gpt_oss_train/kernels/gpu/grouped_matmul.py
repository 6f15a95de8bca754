"""The `grouped_matmul` op's `mosaic_gpu` implementation: on Hopper, JAX's Mosaic GPU
ragged-dot kernels, with a custom VJP:

    y  = ragged_dot(x, w)             [M, K] x [G, K, N] -> [M, N]
    dx = ragged_dot(dy, w^T)          (the same kernel, rhs transposed)
    dw = transposed_ragged_dot(x, dy) -> [G, K, N]  (groups along the contraction)

Tiles must divide the dimensions (gpt-oss: 2880 = 45 x 64); other shapes and GPUs are
declined (`accepts`) and take the XLA reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt_oss_train import sharding

_BLOCK_K = 64


def _mgpu_tiles(k: int, n: int) -> dict | None:
    for block_n in (192, 128, 64):
        if n % block_n == 0 and k % _BLOCK_K == 0:
            return dict(
                block_m=128,
                block_n=block_n,
                block_k=_BLOCK_K,
                max_concurrent_steps=3,
                grid_block_n=1,
            )
    return None


def accepts(x, w, group_sizes=None, out_dtype=None) -> bool:
    """Hopper (compute capability 9.x), bfloat16 operands, tile-divisible sides."""
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        return False
    dev = sharding.device()
    if dev.platform != "gpu" or not str(getattr(dev, "compute_capability", "")).startswith("9"):
        return False
    k, n = w.shape[1], w.shape[2]
    return _mgpu_tiles(k, n) is not None and _mgpu_tiles(n, k) is not None and k % 64 == 0


@jax.custom_vjp
def _mgpu_grouped_matmul(x, w, group_sizes):
    # lazy: optional backend (Mosaic GPU, Hopper only; ~0.3 s to import)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=group_sizes, **_mgpu_tiles(w.shape[1], w.shape[2])
    )


def _mgpu_fwd(x, w, group_sizes):
    return _mgpu_grouped_matmul(x, w, group_sizes), (x, w, group_sizes)


def _mgpu_bwd(res, dy):
    # lazy: optional backend (Mosaic GPU, Hopper only; ~0.3 s to import)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    dx = ragged_dot_mgpu.ragged_dot(
        dy, w, group_sizes=group_sizes, transpose_rhs=True, **_mgpu_tiles(w.shape[2], w.shape[1])
    )
    k, n = w.shape[1], w.shape[2]
    dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(
        x,
        dy,
        group_sizes=group_sizes,
        block_m=64,
        block_n=_mgpu_tiles(k, n)["block_n"],
        block_k=_BLOCK_K,
        max_concurrent_steps=3,
        grid_block_n=1,
    )
    return dx, dw.astype(w.dtype), None


_mgpu_grouped_matmul.defvjp(_mgpu_fwd, _mgpu_bwd)


def grouped_matmul(x, w, group_sizes, out_dtype=None):
    w = w.astype(x.dtype)  # a stand-in (layer view) made dense: the kernel reads arrays
    return _mgpu_grouped_matmul(x, w, group_sizes).astype(out_dtype or jnp.float32)
