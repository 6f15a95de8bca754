"""Decode-time MoE: a Pallas kernel (GPU: Triton lowering) that multiplies the routed rows
by only the experts they chose, at any decode batch size, from a weight layout prepared
once at load.

Routing layout (`tile_layout`): the (token, choice) pairs are sorted by expert and each
expert gets whole tiles of ROWS rows (its last tile padded with zero rows), so every tile
belongs to one expert. The kernel's grid is (tile, output block); a program reads its
tile's expert index from memory, and the tiles past the used ones (expert -1) return at
once. So a step reads each chosen expert once and no other expert: at batch 1 (4 pairs)
that is 4 tiles of 16 rows, 15 of them zero, the "pad the GEMV to 16 rows" shape that made
XLA's gathered path a GEMM on an H200; at batch 64 (256 pairs over 32 experts) each expert
still streams once, where `jax.lax.ragged_dot`'s GPU kernel reads all of them.

Weight layout: [E, out, in], contraction-minor (the profile in docs/PERFORMANCE.md found
the gathered product 1.24x faster so on an H200), gate and up stacked along `out` (gate
rows first) so one call computes both, `in` padded with zeros to a multiple of K_TILE.
MXFP4 weights (mxfp4_experts.py) use the same tiles with their own weight decoding.

moe_decode.py puts both behind the `moe_decode` op.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gpt_oss_train.kernels.xla.experts import ExpertWeights, glu

ROWS = 16  # rows per tile: Triton's smallest matmul side
K_TILE = 64  # inputs per inner step of the bf16 kernel


class DecodeExperts(NamedTuple):
    gate_up: Any  # [E, 2F, D'] array (gate rows, then up rows), or an MXFP4Matrix
    gate_up_bias: jax.Array  # [E, 2F] float32
    down: Any  # [E, D, F'] array, or an MXFP4Matrix
    down_bias: jax.Array  # [E, D] float32


def to_contraction_minor(w: ExpertWeights, dtype=jnp.bfloat16) -> DecodeExperts:
    """Our [E, in, out] expert weights -> the bf16 decode layout (once, at load)."""

    def layout(a):  # [E, in, out] -> [E, out, in padded to K_TILE]
        a = jnp.swapaxes(a, 1, 2).astype(dtype)
        return jnp.pad(a, ((0, 0), (0, 0), (0, (-a.shape[2]) % K_TILE)))

    gate_up = jnp.concatenate([layout(w.wi_gate), layout(w.wi_up)], axis=1)
    bias = jnp.concatenate([w.bi_gate, w.bi_up], axis=1).astype(jnp.float32)
    return DecodeExperts(gate_up, bias, layout(w.wo), w.bo.astype(jnp.float32))


# ----------------------------------------------------------------------------- kernel skeleton


def accumulate_over_chosen_expert(tile_expert_ref, out_ref, num_steps: int, step: Callable):
    """The body every decode expert kernel shares: out = sum over c < num_steps of
    step(c, expert, out_rows), for the tile's expert; unused tiles read nothing and leave
    their (never gathered) output unwritten."""
    expert = tile_expert_ref[pl.program_id(0)]
    block_o = out_ref.shape[1]
    out_rows = pl.ds(pl.program_id(1) * block_o, block_o)

    @pl.when(expert >= 0)
    def _():
        body = lambda c, acc: acc + step(c, expert, out_rows)
        zeros = jnp.zeros(out_ref.shape, jnp.float32)
        out_ref[...] = lax.fori_loop(0, num_steps, body, zeros)


def tiled_call(kernel, tile_expert, row_operands, weight_operands, out_size, *, interpret):
    """pallas_call over (tile, output block): each row operand [tiles*ROWS, n] is cut into
    its tile's ROWS rows; weight operands come whole (the kernel indexes the expert)."""
    rows = row_operands[0].shape[0]
    block_o = next(b for b in (64, 32, 16) if out_size % b == 0)
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, j: (0,) * a.ndim)
    tile = lambda a: pl.BlockSpec((ROWS, a.shape[1]), lambda t, j: (t, 0))
    return pl.pallas_call(
        kernel,
        grid=(rows // ROWS, out_size // block_o),
        in_specs=[whole(tile_expert), *map(tile, row_operands), *map(whole, weight_operands)],
        out_specs=pl.BlockSpec((ROWS, block_o), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((rows, out_size), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"gpt_oss_{kernel.__name__.strip('_')}",
    )(tile_expert, *row_operands, *weight_operands)


def dot_rows(x, w):
    """[rows, k] x [out, k] -> float32 [rows, out] (the weight tile is contraction-minor)."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dense_kernel(tile_expert_ref, x_ref, w_ref, out_ref):
    def step(c, expert, out_rows):
        cols = pl.ds(c * K_TILE, K_TILE)
        return dot_rows(x_ref[:, cols], w_ref[expert, out_rows, cols])

    accumulate_over_chosen_expert(tile_expert_ref, out_ref, w_ref.shape[2] // K_TILE, step)


def dense_matmul(x_rd, tile_expert, w_eoi, *, interpret=False):
    """x [tiles*ROWS, in] (rows in tile order) x each tile's expert [out, in'] -> float32."""
    x = jnp.pad(x_rd.astype(w_eoi.dtype), ((0, 0), (0, w_eoi.shape[2] - x_rd.shape[1])))
    return tiled_call(_dense_kernel, tile_expert, [x], [w_eoi], w_eoi.shape[1], interpret=interpret)


# ----------------------------------------------------------------------------- routing + FFN


class TileLayout(NamedTuple):
    tile_expert: jax.Array  # [tiles] int32: each tile's expert, -1 past the used tiles
    pair_row: jax.Array  # [t*k] int32: the padded row of each (token, choice) pair
    row_expert: jax.Array  # [tiles*ROWS] int32: each row's expert (clipped for unused rows)


def tile_layout(idx_tk, num_experts: int) -> TileLayout:
    """Sort the (token, choice) pairs by expert and give each expert whole tiles of ROWS
    rows. Tiles needed: sum_e ceil(n_e / ROWS) <= pairs // ROWS + min(E, pairs)."""
    flat = idx_tk.reshape(-1)
    pairs = flat.shape[0]
    tiles = pairs // ROWS + min(num_experts, pairs)
    counts = jnp.bincount(flat, length=num_experts)
    expert_tiles = -(-counts // ROWS)
    first_tile = jnp.cumsum(expert_tiles) - expert_tiles
    first_pair = jnp.cumsum(counts) - counts
    order = jnp.argsort(flat, stable=True)
    sorted_expert = flat[order]
    rank = jnp.arange(pairs) - first_pair[sorted_expert]  # place within its expert's rows
    row = first_tile[sorted_expert] * ROWS + rank
    pair_row = jnp.zeros(pairs, jnp.int32).at[order].set(row.astype(jnp.int32))
    t = jnp.arange(tiles)
    tile_expert = jnp.searchsorted(jnp.cumsum(expert_tiles), t, side="right")
    tile_expert = jnp.where(t < jnp.sum(expert_tiles), tile_expert, -1).astype(jnp.int32)
    row_expert = jnp.clip(jnp.repeat(tile_expert, ROWS), 0, num_experts - 1)
    return TileLayout(tile_expert, pair_row, row_expert)


def expert_ffn(x_td, weights_tk, idx_tk, w: DecodeExperts, *, matmul, limit, alpha, dtype):
    """The expert computation of xla/experts.gathered (same result), with `matmul(x,
    tile_expert, weights)` for the weight format."""
    t, k = idx_tk.shape
    layout = tile_layout(idx_tk, w.gate_up_bias.shape[0])
    rows = layout.tile_expert.shape[0] * ROWS
    token = jnp.arange(t * k) // k
    x = jnp.zeros((rows, x_td.shape[1]), dtype).at[layout.pair_row].set(x_td[token].astype(dtype))
    gate_up = matmul(x, layout.tile_expert, w.gate_up) + w.gate_up_bias[layout.row_expert]
    f = gate_up.shape[1] // 2
    act = glu(gate_up[:, :f], gate_up[:, f:], limit, alpha).astype(dtype)
    y = matmul(act, layout.tile_expert, w.down) + w.down_bias[layout.row_expert]
    return jnp.einsum("tk,tkd->td", weights_tk, y[layout.pair_row].reshape(t, k, -1))


def dense_ffn(x_td, weights_tk, idx_tk, w: DecodeExperts, *, limit, alpha, dtype, interpret=False):
    """`expert_ffn` over bf16 (or any float) contraction-minor weights."""
    matmul = functools.partial(dense_matmul, interpret=interpret)
    return expert_ffn(
        x_td, weights_tk, idx_tk, w, matmul=matmul, limit=limit, alpha=alpha, dtype=dtype
    )
