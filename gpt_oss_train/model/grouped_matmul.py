"""Grouped matmul, the MoE's core product, with the fastest kernel each platform has.

    grouped_matmul(x [M, K], w [G, K, N], group_sizes [G]) -> float32 [M, N]

Rows are grouped contiguously: the first group_sizes[0] rows use w[0], the next
group_sizes[1] rows w[1], ...; rows past sum(group_sizes) come out as zeros.

Kernels (`kernel_for` picks one from the platform being compiled for):
  mosaic      JAX's Mosaic GPU ragged-dot kernels (Hopper, bf16, tile-divisible shapes).
  ragged_dot  `jax.lax.ragged_dot`: TPUs lower it natively. XLA's CPU and GPU lowerings
              multiply every row by every group's weights (G times the FLOPs: 35x slower
              than the useful work at 32 experts on a CPU).
  tiled       everywhere else: a loop over tiles of `block` rows, each tile inside one
              group and multiplied by that group's weights alone. A group of n rows takes
              ceil(n / block) tiles, so FLOPs are (M + at most G * (block - 1)) * K * N,
              forward and backward (a custom VJP: dx and dW are tile loops too).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gpt_oss_train import sharding

# ----------------------------------------------------------------------------- tiled
#
# Tiles walk the rows in order: group g's tiles start at its first row and step by
# `block`, so a group's last tile overhangs into the next group's rows (or past the end).
# Overhanging rows are masked to zero on input, so they contribute nothing to dW and
# write zeros, which the next group's own tiles (later in the loop) overwrite.


def tile_rows(num_rows: int, num_groups: int) -> int:
    """Rows per tile: about the mean group size (less padding when groups are small),
    within [8, 128]. On a 2-core Zen 3, XLA's CPU matmul runs 64- to 1024-row products
    at the same FLOP rate, so small tiles cost little; under 32 rows it falls off."""
    mean = max(1, num_rows // max(1, num_groups))
    return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def _schedule(group_sizes, block: int, num_rows: int):
    """Per tile (static upper bound on their number): its group, first row and the end
    of its group's rows; and how many tiles are used."""
    num_groups = group_sizes.shape[0]
    num_tiles = -(-num_rows // block) + min(num_groups, num_rows)
    sizes = group_sizes.astype(jnp.int32)
    tiles_per_group = (sizes + block - 1) // block
    tile_end = jnp.cumsum(tiles_per_group)
    row_end = jnp.cumsum(sizes)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), num_groups - 1)
    first = row_end[group] - sizes[group] + (t - (tile_end[group] - tiles_per_group[group])) * block
    return group, first, row_end[group], tile_end[-1]


def _tile(a_mk, first, end, block: int):
    """Rows [first, first + block) of a (zero-padded by `block` rows), those at or past
    `end` zeroed."""
    rows = jax.lax.dynamic_slice_in_dim(a_mk, first, block, axis=0)
    keep = first + jnp.arange(block) < end
    return jnp.where(keep[:, None], rows, jnp.zeros_like(rows))


def _acc(dtype):
    """Accumulation dtype: float32, or float64 for float64 operands (reference tests)."""
    return jnp.promote_types(dtype, jnp.float32)


def _pad(a_mk, block: int):
    return jnp.pad(a_mk, ((0, block), (0, 0)))


def _weight(w, g, dtype):
    """Group g's [K, N] weight in the compute dtype. An int8 QArray is sliced first and
    dequantized per tile, so only the chosen groups' int8 bytes are read."""
    return w[g].astype(dtype)


def _tiled_forward(x, w, group_sizes, block):
    m, n = x.shape[0], w.shape[2]
    group, first, end, count = _schedule(group_sizes, block, m)
    xp = _pad(x, block)

    def body(i, y):
        xb = _tile(xp, first[i], end[i], block)
        yb = jnp.dot(xb, _weight(w, group[i], x.dtype), preferred_element_type=_acc(x.dtype))
        return jax.lax.dynamic_update_slice_in_dim(y, yb, first[i], axis=0)

    y = jax.lax.fori_loop(0, count, body, jnp.zeros((m + block, n), _acc(x.dtype)))
    return y[:m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tiled_grouped_matmul(x, w, group_sizes, block: int):
    """[M, K] x [G, K, N] -> [M, N] (float32 or wider) by tiles of `block` rows."""
    return _tiled_forward(x, w, group_sizes, block)


def _tiled_fwd(x, w, group_sizes, block):
    return _tiled_forward(x, w, group_sizes, block), (x, w, group_sizes)


def _tiled_bwd(block, res, dy):
    """One loop over the same tiles: dx tile = dy tile @ w[g]^T; dW[g] += x tile^T dy tile."""
    x, w, group_sizes = res
    m, k = x.shape
    group, first, end, count = _schedule(group_sizes, block, m)
    xp, dyp = _pad(x, block), _pad(dy.astype(x.dtype), block)
    f32 = _acc(x.dtype)

    def body(i, carry):
        dx, dw = carry
        g = group[i]
        xb = _tile(xp, first[i], end[i], block)
        dyb = _tile(dyp, first[i], end[i], block)
        dxb = jax.lax.dot_general(
            dyb, _weight(w, g, x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=f32
        )
        dwg = jax.lax.dot_general(xb, dyb, (((0,), (0,)), ((), ())), preferred_element_type=f32)
        dx = jax.lax.dynamic_update_slice_in_dim(dx, dxb, first[i], axis=0)
        dw = jax.lax.dynamic_update_index_in_dim(dw, dw[g] + dwg, g, axis=0)
        return dx, dw

    init = (jnp.zeros((m + block, k), f32), jnp.zeros(w.shape, f32))
    dx, dw = jax.lax.fori_loop(0, count, body, init)
    return dx[:m].astype(x.dtype), dw.astype(w.dtype), None


tiled_grouped_matmul.defvjp(_tiled_fwd, _tiled_bwd)


# ----------------------------------------------------------------------------- mosaic
#
# On Hopper, JAX's Mosaic GPU ragged-dot kernels, with a custom VJP:
#   y  = ragged_dot(x, w)            [M,K] x [G,K,N] -> [M,N]
#   dx = ragged_dot(dy, w^T)         (the same kernel, rhs transposed)
#   dw = transposed_ragged_dot(x, dy) -> [G,K,N]  (groups along the contraction)
# Tiles must divide the dimensions (gpt-oss: 2880 = 45 x 64).

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


def use_mosaic(x, w) -> bool:
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        return False
    dev = sharding.device()
    if dev.platform != "gpu" or not str(getattr(dev, "compute_capability", "")).startswith("9"):
        return False
    k, n = w.shape[1], w.shape[2]
    return _mgpu_tiles(k, n) is not None and _mgpu_tiles(n, k) is not None and k % 64 == 0


@jax.custom_vjp
def _mgpu_grouped_matmul(x, w, group_sizes):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=group_sizes, **_mgpu_tiles(w.shape[1], w.shape[2])
    )


def _mgpu_fwd(x, w, group_sizes):
    return _mgpu_grouped_matmul(x, w, group_sizes), (x, w, group_sizes)


def _mgpu_bwd(res, dy):
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


# ----------------------------------------------------------------------------- dispatch


def kernel_for(x, w) -> str:
    """'mosaic', 'ragged_dot' or 'tiled' for these operands on the platform being
    compiled for (the active mesh's devices, so AOT compiles for a TPU choose TPU's)."""
    if use_mosaic(x, w):
        return "mosaic"
    return "ragged_dot" if sharding.platform() == "tpu" else "tiled"


def grouped_matmul(x, w, group_sizes, kernel: str | None = None):
    """[M, K] x [G, K, N] -> float32 [M, N]; rows grouped contiguously by group_sizes.
    `w` may be an int8 QArray (dequantized per group by the tiled kernel, whole
    otherwise). `kernel`: force one of kernel_for's answers (benchmarks, tests)."""
    kernel = kernel or kernel_for(x, w)
    if kernel == "tiled":
        return tiled_grouped_matmul(x, w, group_sizes, tile_rows(x.shape[0], w.shape[0]))
    w = w.astype(x.dtype)
    if kernel == "mosaic":
        return _mgpu_grouped_matmul(x, w, group_sizes).astype(jnp.float32)
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=_acc(x.dtype))
