"""The `grouped_matmul` op's reference: tiled loops over each group's rows.

    grouped_matmul(x [M, K], w [G, K, N], group_sizes [G], out_dtype=None) -> [M, N]

accumulated in float32 and returned in it, or rounded to `out_dtype` (the MoE asks for
its compute dtype where platforms.Facts.expert_products_in_compute_dtype says so).

Rows are grouped contiguously: the first group_sizes[0] rows use w[0], the next
group_sizes[1] rows w[1], ...; rows past sum(group_sizes) come out as zeros. `w` may be a
weight stand-in (an int8 QArray, a layer view): each group's matrix is sliced, then made
dense, so only the groups used are read.

`jax.lax.ragged_dot` is XLA's own op for this, lowered natively on TPUs (tpu/ragged_dot.py),
but XLA's CPU and GPU lowerings multiply every row by every group's weights (G times the
FLOPs: 35x slower than the useful work at 32 experts on a CPU). The tiled loops cost the
FLOPs of the M rows plus under one small tile of padding per group, forward and backward
(a custom VJP: dx and dW are tile loops too).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# ----------------------------------------------------------------------------- tiled
#
# A loop over the groups that have rows; inside, a loop over the group's rows in full
# tiles of `big` rows, then tiles of `small` rows for the rest. The group's weight is
# sliced (and cast, or dequantized) once per group, dW accumulates in a [K, N] carry
# written once per group. The last small tile overhangs into the next group's rows (or
# past the end): those rows are masked to zero on input, so they add nothing to dW and
# write zeros that the next group's own tiles, later in the loop, overwrite.


class Tiles(NamedTuple):
    big: int  # rows of the full tiles
    small: int  # rows of the tiles that cover the rest (padding < small rows per group)


def tile_rows(num_rows: int, num_groups: int) -> Tiles:
    """Tiles for `num_rows` rows over `num_groups` groups: big tiles about the mean group
    size, within [8, 128]; small ones a quarter of that (at least 8). On a 2-core Zen 3,
    XLA's CPU matmul runs 64- to 1024-row products at about the same FLOP rate and
    falls off under 32 rows, while each tile costs a loop step."""
    mean = max(1, num_rows // max(1, num_groups))
    big = int(min(128, max(8, 1 << (mean - 1).bit_length())))
    return Tiles(big, max(8, big // 4))


def _acc(dtype):
    """Accumulation dtype: float32, or float64 for float64 operands (reference tests)."""
    return jnp.promote_types(dtype, jnp.float32)


def _groups(group_sizes):
    """Per group: size and first row; the groups with rows (the first `count` of `used`,
    in order)."""
    sizes = group_sizes.astype(jnp.int32)
    (used,) = jnp.nonzero(sizes > 0, size=sizes.shape[0], fill_value=0)
    return sizes, jnp.cumsum(sizes) - sizes, used, jnp.sum(sizes > 0)


def _rows(a_mk, first, rows: int, end):
    """a[first : first + rows] (a is zero-padded at the end), rows at or past `end`
    zeroed (end=None: a full tile, nothing to mask)."""
    tile = jax.lax.dynamic_slice_in_dim(a_mk, first, rows, axis=0)
    if end is None:
        return tile
    keep = first + jnp.arange(rows) < end
    return jnp.where(keep[:, None], tile, jnp.zeros_like(tile))


def _over_tiles(tiles: Tiles, start, size, body, carry):
    """carry = body(carry, first_row, rows, end) over one group's rows
    [start, start + size): full `big` tiles (end=None), then `small` ones."""
    full = size // tiles.big
    carry = jax.lax.fori_loop(
        0, full, lambda j, c: body(c, start + j * tiles.big, tiles.big, None), carry
    )
    rest = start + full * tiles.big
    count = (start + size - rest + tiles.small - 1) // tiles.small
    return jax.lax.fori_loop(
        0, count, lambda j, c: body(c, rest + j * tiles.small, tiles.small, start + size), carry
    )


def _pad(a_mk, tiles: Tiles):
    return jnp.pad(a_mk, ((0, tiles.small), (0, 0)))


def _tiled_forward(x, w, group_sizes, tiles: Tiles):
    m, n = x.shape[0], w.shape[2]
    sizes, starts, used, count = _groups(group_sizes)
    xp, acc = _pad(x, tiles), _acc(x.dtype)

    def per_group(i, y):
        g = used[i]
        # An int8 QArray is sliced, then dequantized: only chosen groups' bytes are read.
        w_kn = w[g].astype(x.dtype)

        def tile(y, first, rows, end):
            y_tile = jnp.dot(_rows(xp, first, rows, end), w_kn, preferred_element_type=acc)
            return jax.lax.dynamic_update_slice_in_dim(y, y_tile, first, axis=0)

        return _over_tiles(tiles, starts[g], sizes[g], tile, y)

    y = jax.lax.fori_loop(0, count, per_group, jnp.zeros((m + tiles.small, n), acc))
    return y[:m]


def tiled_grouped_matmul(x, w, group_sizes, tiles: Tiles):
    """[M, K] x [G, K, N] -> [M, N] (float32 or wider), tile by tile (see above)."""
    big = max(1, min(tiles.big, x.shape[0]))  # no tile longer than the rows
    return _tiled(x, w, group_sizes, Tiles(big, max(1, min(tiles.small, big))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x, w, group_sizes, tiles: Tiles):
    return _tiled_forward(x, w, group_sizes, tiles)


def _tiled_fwd(x, w, group_sizes, tiles):
    return _tiled_forward(x, w, group_sizes, tiles), (x, w, group_sizes)


def _tiled_bwd(tiles, res, dy):
    """The same loops: dx tile = dy tile @ w[g]^T; dW[g] = sum over its tiles of
    x tile^T dy tile. Masking dy's overhanging rows keeps them out of both."""
    x, w, group_sizes = res
    m, k = x.shape
    sizes, starts, used, count = _groups(group_sizes)
    xp, dyp, acc = _pad(x, tiles), _pad(dy.astype(x.dtype), tiles), _acc(x.dtype)
    if not isinstance(w, jax.Array):  # packed (int8, MXFP4): a frozen base, no dW
        return _tiled_dx(xp, dyp, w, sizes, starts, used, count, tiles)[:m], _no_grad(w), None

    def per_group(i, carry):
        dx, dw = carry
        g = used[i]
        w_nk = jnp.transpose(w[g].astype(x.dtype))  # once per group, not per tile

        def tile(c, first, rows, end):
            dx, dw_kn = c
            x_tile, dy_tile = _rows(xp, first, rows, None), _rows(dyp, first, rows, end)
            dx_tile = jnp.dot(dy_tile, w_nk, preferred_element_type=acc)
            dw_kn += jax.lax.dot_general(
                x_tile, dy_tile, (((0,), (0,)), ((), ())), preferred_element_type=acc
            )
            return jax.lax.dynamic_update_slice_in_dim(dx, dx_tile, first, axis=0), dw_kn

        dx, dw_kn = _over_tiles(tiles, starts[g], sizes[g], tile, (dx, jnp.zeros(w.shape[1:], acc)))
        return dx, jax.lax.dynamic_update_index_in_dim(dw, dw_kn, g, axis=0)

    init = (jnp.zeros((m + tiles.small, k), acc), jnp.zeros(w.shape, acc))
    dx, dw = jax.lax.fori_loop(0, count, per_group, init)
    return dx[:m].astype(x.dtype), dw.astype(w.dtype), None


def _tiled_dx(xp, dyp, w, sizes, starts, used, count, tiles: Tiles):
    """dx alone (the weights are not trained): the backward's loops without dW."""
    acc = _acc(xp.dtype)

    def per_group(i, dx):
        g = used[i]
        w_nk = jnp.transpose(w[g].astype(xp.dtype))

        def tile(dx, first, rows, end):
            dx_tile = jnp.dot(_rows(dyp, first, rows, end), w_nk, preferred_element_type=acc)
            return jax.lax.dynamic_update_slice_in_dim(dx, dx_tile, first, axis=0)

        return _over_tiles(tiles, starts[g], sizes[g], tile, dx)

    dx = jax.lax.fori_loop(0, count, per_group, jnp.zeros((xp.shape[0], xp.shape[1]), acc))
    return dx.astype(xp.dtype)


def _no_grad(w):
    """Zero cotangents in w's own structure (float0 for integer leaves)."""
    zero = lambda a: (
        jnp.zeros_like(a)
        if jnp.issubdtype(a.dtype, jnp.floating)
        else np.zeros(a.shape, jax.dtypes.float0)
    )
    return jax.tree.map(zero, w)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def tiled(x, w, group_sizes, out_dtype=None):
    """The op: tiles sized by the rows per group (`tile_rows`)."""
    y = tiled_grouped_matmul(x, w, group_sizes, tile_rows(x.shape[0], w.shape[0]))
    return y if out_dtype is None else y.astype(out_dtype)
