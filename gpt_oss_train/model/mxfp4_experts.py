"""MXFP4 experts for decode: the checkpoint's 4-bit weights stay 4-bit in device memory and
are dequantized inside a Pallas kernel (GPU: Triton lowering) that reads only the experts
the tokens chose. gpt-oss-20b's experts take 12 GiB this way instead of 39 GiB in bf16.

Layout, prepared once at load (`prepare_matrix`, numpy): for each projection, uint8
blocks [E, O, Gp*16] and scales [E, O, Gp] in the checkpoint's (out, in) order, i.e.
contraction-minor, with the 32-element groups padded from G = in/32 to Gp (a multiple of
GROUP_TILE; padding bytes are code 0 = +0.0). Byte c of a row holds input elements 2c (low
nibble) and 2c+1 (high nibble), so the kernel never interleaves nibbles: the activations
are split into their even and odd elements instead, and row . x = lo . x_even + hi . x_odd.
gate and up are stacked along O (gate rows first), so one kernel call computes both.

The kernel multiplies rows grouped by expert in tiles of ROWS rows (the tile-padded sorted
order of `_tile_layout`: each tile belongs to one expert, an expert's last tile is padded
with zero rows). Its grid is (tile, output block); each program reads its tile's expert
index from memory, and tiles past the used ones (expert -1) return at once, so a decode
step reads each chosen expert once and no other expert, at any batch size. At batch 1
(4 pairs) that is 4 tiles of 16 rows, 15 of them zero: the "pad the GEMV to 16 rows" shape
that made XLA's gathered path a GEMM on an H200 (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gpt_oss_train.io.mxfp4 import quantize_mxfp4
from gpt_oss_train.model import moe as moe_lib

ROWS = 16  # rows per tile: Triton's smallest matmul side
GROUP_TILE = 8  # 32-element groups per inner step: 256 inputs, 128 bytes of each weight row


class MXFP4Matrix(NamedTuple):
    """One projection of every expert, x @ W as rows . x: blocks uint8 [E, O, Gp*16],
    scales uint8 [E, O, Gp] (E8M0: 2^(s - 127))."""

    blocks: jax.Array
    scales: jax.Array


class MXFP4Experts(NamedTuple):
    gate_up: MXFP4Matrix  # O = 2F: gate rows, then up rows; input D
    gate_up_bias: jax.Array  # [E, 2F]
    down: MXFP4Matrix  # O = D; input F
    down_bias: jax.Array  # [E, D]


# ----------------------------------------------------------------------------- layout (at load)


def prepare_matrix(blocks: np.ndarray, scales: np.ndarray) -> MXFP4Matrix:
    """Checkpoint arrays (blocks uint8 [E, O, G, 16], scales uint8 [E, O, G]) -> the
    kernel's layout: groups padded to a multiple of GROUP_TILE, rows flattened."""
    e, o, g, _ = blocks.shape
    if o % ROWS:
        raise ValueError(f"MXFP4 experts: output size {o} must be a multiple of {ROWS}")
    gp = -(-g // GROUP_TILE) * GROUP_TILE
    blocks = np.pad(blocks, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    scales = np.pad(scales, ((0, 0), (0, 0), (0, gp - g)))
    return MXFP4Matrix(blocks.reshape(e, o, gp * 16), scales)


def from_hf(gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias):
    """One layer's HF tensors (`mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}`) ->
    MXFP4Experts. HF interleaves gate and up rows (gate even, up odd); we stack them."""
    split = lambda a: np.concatenate([a[:, 0::2], a[:, 1::2]], axis=1)
    return MXFP4Experts(
        prepare_matrix(split(gate_up_blocks), split(gate_up_scales)),
        jnp.asarray(split(gate_up_bias), jnp.float32),
        prepare_matrix(down_blocks, down_scales),
        jnp.asarray(down_bias, jnp.float32),
    )


def from_dense(w: moe_lib.ExpertWeights) -> MXFP4Experts:
    """Quantize our float expert weights ([E, in, out]) to MXFP4 (round to nearest even):
    for tests, and to serve a bf16 checkpoint from 4-bit weights."""
    quant = lambda a: prepare_matrix(*quantize_mxfp4(np.asarray(a, np.float32)))
    gate_up = np.concatenate([np.asarray(w.wi_gate), np.asarray(w.wi_up)], axis=2)
    bias = np.concatenate([np.asarray(w.bi_gate), np.asarray(w.bi_up)], axis=1)
    return MXFP4Experts(quant(gate_up), jnp.asarray(bias, jnp.float32), quant(w.wo), w.bo)


# ----------------------------------------------------------------------------- kernel


def _e2m1(code):
    """int32 E2M1 codes 0..15 -> float32: bit 3 sign, bits 2-1 exponent, bit 0 mantissa."""
    exp, man = (code >> 1) & 3, code & 1
    # exponent 0 is subnormal (0 or 0.5); else (1 + man/2) * 2^(exp-1) = (2 + man) * 2^exp / 4
    mag = jnp.where(exp == 0, man * 0.5, ((2 + man) << exp).astype(jnp.float32) * 0.25)
    return jnp.where((code & 8) != 0, -mag, mag)


def _e8m0(code):
    """uint8 E8M0 scales -> float32 2^(s - 127), exactly, by building the float's bits
    (s = 0, i.e. 2^-127, comes out 0: it only scales all-zero groups, see quantize_mxfp4)."""
    return lax.bitcast_convert_type(code.astype(jnp.int32) << 23, jnp.float32)


def _kernel(tile_expert_ref, x_even_ref, x_odd_ref, blocks_ref, scales_ref, out_ref):
    """One (tile, output block): out = x_even . lo^T + x_odd . hi^T over the tile's expert,
    dequantizing GROUP_TILE groups of the weight rows per step."""
    expert = tile_expert_ref[pl.program_id(0)]
    block_o = out_ref.shape[1]
    rows = pl.ds(pl.program_id(1) * block_o, block_o)
    width = GROUP_TILE * 16  # bytes per row per step

    @pl.when(expert >= 0)  # unused tiles read no weights (their rows are never gathered)
    def _():
        def step(c, acc):
            cols = pl.ds(c * width, width)
            codes = blocks_ref[expert, rows, cols].astype(jnp.int32)  # [block_o, width]
            scale = _e8m0(scales_ref[expert, rows, pl.ds(c * GROUP_TILE, GROUP_TILE)])
            # each scale covers 16 consecutive bytes (32 inputs) of its row
            scale = jnp.broadcast_to(scale[:, :, None], (block_o, GROUP_TILE, 16))
            scale = scale.reshape(block_o, width)
            x_even, x_odd = x_even_ref[:, cols], x_odd_ref[:, cols]
            lo = (_e2m1(codes & 15) * scale).astype(x_even.dtype)  # exact: 2 bits of mantissa
            hi = (_e2m1(codes >> 4) * scale).astype(x_even.dtype)
            dims = (((1,), (1,)), ((), ()))
            acc += lax.dot_general(x_even, lo, dims, preferred_element_type=jnp.float32)
            return acc + lax.dot_general(x_odd, hi, dims, preferred_element_type=jnp.float32)

        steps = blocks_ref.shape[2] // width
        out_ref[...] = lax.fori_loop(0, steps, step, jnp.zeros(out_ref.shape, jnp.float32))


def _block_o(o: int) -> int:
    return next(b for b in (64, 32, 16) if o % b == 0)


def mxfp4_matmul(x_rd, tile_expert, w: MXFP4Matrix, *, interpret: bool = False):
    """x [tiles*ROWS, in] (rows in tile order) x the tiles' experts -> float32 [rows, O].
    Rows of unused tiles (expert -1) come out undefined."""
    r, d = x_rd.shape
    e, o, width = w.blocks.shape
    x = jnp.pad(x_rd, ((0, 0), (0, width * 2 - d)))  # zero inputs meet the padding groups
    x_even, x_odd = x[:, 0::2], x[:, 1::2]
    block_o = _block_o(o)
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, j: (0,) * a.ndim)
    tile_rows = pl.BlockSpec((ROWS, width), lambda t, j: (t, 0))
    return pl.pallas_call(
        _kernel,
        grid=(r // ROWS, o // block_o),
        in_specs=[whole(tile_expert), tile_rows, tile_rows, whole(w.blocks), whole(w.scales)],
        out_specs=pl.BlockSpec((ROWS, block_o), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((r, o), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="gpt_oss_mxfp4_experts",
    )(tile_expert, x_even, x_odd, w.blocks, w.scales)


# ----------------------------------------------------------------------------- routing layout


class TileLayout(NamedTuple):
    tile_expert: jax.Array  # [tiles] int32: each tile's expert, -1 past the used tiles
    pair_row: jax.Array  # [t*k] int32: the padded row of each (token, choice) pair
    row_expert: jax.Array  # [tiles*ROWS] int32: each row's expert (clipped for unused rows)


def _tile_layout(idx_tk, num_experts: int) -> TileLayout:
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


def mxfp4_ffn(x_td, weights_tk, idx_tk, w: MXFP4Experts, *, limit, alpha, dtype, interpret=False):
    """The MoE expert computation of `moe.gathered_ffn`, from MXFP4 weights."""
    t, k = idx_tk.shape
    num_experts = w.gate_up.blocks.shape[0]
    layout = _tile_layout(idx_tk, num_experts)
    rows = layout.tile_expert.shape[0] * ROWS
    token = jnp.arange(t * k) // k
    x = jnp.zeros((rows, x_td.shape[1]), dtype).at[layout.pair_row].set(x_td[token].astype(dtype))
    matmul = functools.partial(mxfp4_matmul, interpret=interpret)
    gate_up = matmul(x, layout.tile_expert, w.gate_up) + w.gate_up_bias[layout.row_expert]
    f = gate_up.shape[1] // 2
    act = moe_lib._glu(gate_up[:, :f], gate_up[:, f:], limit, alpha).astype(dtype)
    y = matmul(act, layout.tile_expert, w.down) + w.down_bias.astype(jnp.float32)[layout.row_expert]
    return jnp.einsum("tk,tkd->td", weights_tk, y[layout.pair_row].reshape(t, k, -1))
