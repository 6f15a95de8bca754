"""MXFP4 experts for decode: the checkpoint's 4-bit weights stay 4-bit in device memory and
are dequantized inside the decode expert kernel (decode_experts.py: only the chosen experts
are read). gpt-oss-20b's experts take 12 GiB this way instead of 39 GiB in bf16.

Layout, prepared once at load (`prepare_matrix`, numpy): for each projection, uint8
blocks [E, O, Gp*16] and scales [E, O, Gp] in the checkpoint's (out, in) order, i.e.
contraction-minor, with the 32-element groups padded from G = in/32 to Gp (a multiple of
GROUP_TILE; padding bytes are code 0 = +0.0). Byte c of a row holds input elements 2c (low
nibble) and 2c+1 (high nibble), so the kernel never interleaves nibbles: the activations
are split into their even and odd elements instead, and row . x = lo . x_even + hi . x_odd.
gate and up are stacked along O (gate rows first), as in the bf16 decode layout.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from gpt_oss_train.arrays.mxfp4 import quantize_mxfp4
from gpt_oss_train.arrays.mxfp4_array import MXFP4Array, to_file
from gpt_oss_train.kernels.gpu import decode_experts as dex
from gpt_oss_train.kernels.xla.experts import ExpertWeights

GROUP_TILE = 8  # 32-element groups per inner step: 256 inputs, 128 bytes of each weight row


class MXFP4Matrix(NamedTuple):
    """One projection of every expert, x @ W as rows . x: blocks uint8 [E, O, Gp*16],
    scales uint8 [E, O, Gp] (E8M0: 2^(s - 127))."""

    blocks: jax.Array
    scales: jax.Array


# ----------------------------------------------------------------------------- layout (at load)


def prepare_matrix(blocks: np.ndarray, scales: np.ndarray) -> MXFP4Matrix:
    """Checkpoint arrays (blocks uint8 [E, O, G, 16], scales uint8 [E, O, G]) -> the
    kernel's layout: groups padded to a multiple of GROUP_TILE, rows flattened."""
    e, o, g, _ = blocks.shape
    if o % dex.ROWS:
        raise ValueError(f"MXFP4 experts: output size {o} must be a multiple of {dex.ROWS}")
    gp = -(-g // GROUP_TILE) * GROUP_TILE
    blocks = np.pad(blocks, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    scales = np.pad(scales, ((0, 0), (0, 0), (0, gp - g)))
    return MXFP4Matrix(blocks.reshape(e, o, gp * 16), scales)


def from_hf(gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias):
    """One layer's HF tensors (`mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}`) ->
    DecodeExperts. HF interleaves gate and up rows (gate even, up odd); we stack them."""
    split = lambda a: np.concatenate([a[:, 0::2], a[:, 1::2]], axis=1)
    return dex.DecodeExperts(
        prepare_matrix(split(gate_up_blocks), split(gate_up_scales)),
        jnp.asarray(split(gate_up_bias), jnp.float32),
        prepare_matrix(down_blocks, down_scales),
        jnp.asarray(down_bias, jnp.float32),
    )


def from_dense(w: ExpertWeights) -> dex.DecodeExperts:
    """Quantize our float expert weights ([E, in, out]) to MXFP4 (round to nearest even):
    for tests, and to serve a bf16 checkpoint from 4-bit weights."""
    quant = lambda a: prepare_matrix(*quantize_mxfp4(np.asarray(a, np.float32)))
    gate_up = np.concatenate([np.asarray(w.wi_gate), np.asarray(w.wi_up)], axis=2)
    bias = np.concatenate([np.asarray(w.bi_gate), np.asarray(w.bi_up)], axis=1)
    return dex.DecodeExperts(
        quant(gate_up), jnp.asarray(bias, jnp.float32), quant(w.wo), jnp.asarray(w.bo, jnp.float32)
    )


def _padded(w):
    """prepare_matrix in jax, for an MXFP4Array already on the device: its blocks and
    scales transposed back to the file's (out, in) order, then padded."""
    blocks, scales = to_file(w.blocks, w.scales)
    e, o, g, _ = blocks.shape
    gp = -(-g // GROUP_TILE) * GROUP_TILE
    blocks = jnp.pad(blocks, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    scales = jnp.pad(scales, ((0, 0), (0, 0), (0, gp - g)))
    return MXFP4Matrix(blocks.reshape(e, o, gp * 16), scales)


def from_packed(w: ExpertWeights) -> dex.DecodeExperts:
    """The model's packed experts (MXFP4Arrays, blocks [E, in/8, out]) -> the kernel's
    layout (the layer's blocks transposed each call), gate and up rows stacked."""
    gate_up = _padded(
        MXFP4Array(
            jnp.concatenate([w.wi_gate.blocks, w.wi_up.blocks], axis=2),
            jnp.concatenate([w.wi_gate.scales, w.wi_up.scales], axis=2),
        )
    )
    bias = jnp.concatenate([w.bi_gate, w.bi_up], axis=1).astype(jnp.float32)
    down = _padded(w.wo)
    return dex.DecodeExperts(gate_up, bias, down, w.bo.astype(jnp.float32))


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


def _mxfp4_kernel(tile_expert_ref, x_even_ref, x_odd_ref, blocks_ref, scales_ref, out_ref):
    """out = x_even . lo^T + x_odd . hi^T, dequantizing GROUP_TILE groups per step."""
    width = GROUP_TILE * 16  # bytes of a weight row per step

    def step(c, expert, out_rows):
        cols = pl.ds(c * width, width)
        codes = blocks_ref[expert, out_rows, cols].astype(jnp.int32)  # [block_o, width]
        scale = _e8m0(scales_ref[expert, out_rows, pl.ds(c * GROUP_TILE, GROUP_TILE)])
        # each scale covers 16 consecutive bytes (32 inputs) of its row
        block_o = scale.shape[0]
        scale = jnp.broadcast_to(scale[:, :, None], (block_o, GROUP_TILE, 16))
        scale = scale.reshape(block_o, width)
        x_even, x_odd = x_even_ref[:, cols], x_odd_ref[:, cols]
        lo = (_e2m1(codes & 15) * scale).astype(x_even.dtype)  # exact: 2 bits of mantissa
        hi = (_e2m1(codes >> 4) * scale).astype(x_even.dtype)
        return dex.dot_rows(x_even, lo) + dex.dot_rows(x_odd, hi)

    steps = blocks_ref.shape[2] // width
    dex.accumulate_over_chosen_expert(tile_expert_ref, out_ref, steps, step)


def mxfp4_matmul(x_rd, tile_expert, w: MXFP4Matrix, *, interpret: bool = False):
    """x [tiles*ROWS, in] (rows in tile order) x each tile's expert -> float32 [rows, O].
    Rows of unused tiles (expert -1) come out undefined."""
    width = w.blocks.shape[2]
    x = jnp.pad(x_rd, ((0, 0), (0, width * 2 - x_rd.shape[1])))  # zeros meet padding groups
    return dex.tiled_call(
        _mxfp4_kernel,
        tile_expert,
        [x[:, 0::2], x[:, 1::2]],
        [w.blocks, w.scales],
        w.blocks.shape[1],
        interpret=interpret,
    )


def mxfp4_ffn(
    x_td, weights_tk, idx_tk, w: dex.DecodeExperts, *, limit, alpha, dtype, interpret=False
):
    """The expert computation of xla/experts.gathered, from MXFP4 weights."""
    matmul = functools.partial(mxfp4_matmul, interpret=interpret)
    return dex.expert_ffn(
        x_td, weights_tk, idx_tk, w, matmul=matmul, limit=limit, alpha=alpha, dtype=dtype
    )
