"""MXFP4, the 4-bit expert-weight format of the published gpt-oss checkpoints, in numpy.

A weight matrix is stored in blocks of 32 consecutive elements along its input axis; each
block shares one scale. An element is an E2M1 (FP4) code: bit 3 sign, bits 2-1 exponent,
bit 0 mantissa, so the magnitudes are 0, .5, 1, 1.5, 2, 3, 4, 6 (see ``FP4_VALUES``). Two
codes share a byte, the low nibble first (element 2i low, 2i+1 high). A scale is an E8M0
byte s meaning 2**(s - 127), so decoding is exact in float32.

On disk (``{gate_up,down}_proj_blocks`` / ``_scales``) the arrays are uint8
[E, out, in/32, 16] and [E, out, in/32], in (out, in) order; ``dequantize_mxfp4``
returns them transposed to the [E, in, out] orientation used as ``x @ W``, and
``quantize_mxfp4`` is its inverse.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["FP4_VALUES", "dequantize_mxfp4", "quantize_mxfp4"]

# E2M1 (FP4) code -> value: bit 3 sign, bits 2-1 exponent, bit 0 mantissa.
FP4_VALUES = np.array(
    [
        +0.0,
        +0.5,
        +1.0,
        +1.5,
        +2.0,
        +3.0,
        +4.0,
        +6.0,
        -0.0,
        -0.5,
        -1.0,
        -1.5,
        -2.0,
        -3.0,
        -4.0,
        -6.0,
    ],
    dtype=np.float32,
)

# Byte -> its two values: [b, 0] = low nibble (element 2i), [b, 1] = high nibble (2i+1).
_FP4_PAIRS = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], -1)
_DEQ_ROWS = 256  # output rows per chunk: keeps the temporaries small and the transpose cached


def _dequant_rows(blk: np.ndarray, scl: np.ndarray, out_t: np.ndarray) -> None:
    """blk uint8 [O, G, 16], scl uint8 [O, G] -> writes out_t [G*32, O] (float32)."""
    o, g, _ = blk.shape
    for r0 in range(0, o, _DEQ_ROWS):
        r1 = min(o, r0 + _DEQ_ROWS)
        vals = _FP4_PAIRS[blk[r0:r1]]  # [r, G, 16, 2]
        exp = scl[r0:r1].astype(np.int32) - 127
        np.ldexp(vals, exp[:, :, None, None], out=vals)  # exact (power-of-two scaling)
        out_t[:, r0:r1] = vals.reshape(r1 - r0, g * 32).T


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 -> float32, transposed to the (in, out) orientation used as ``x @ W``.

    blocks: uint8 [..., out, nblk, 16]; each byte holds two E2M1 codes, the low nibble
    being element 2i and the high nibble element 2i+1 of a 32-element block along the input
    axis. scales: uint8 [..., out, nblk], E8M0 (value = code * 2**(scale - 127)).
    Returns float32 [..., in = nblk*32, out]. Processes one leading index at a time.
    """
    blocks = np.asarray(blocks)
    scales = np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} / scales {scales.shape}: expected "
            "blocks [..., out, nblk, 16] and scales [..., out, nblk]"
        )
    *lead, o, g, _ = blocks.shape
    out = np.empty((*lead, g * 32, o), np.float32)
    n = math.prod(lead)
    b2 = blocks.reshape(n, o, g, 16)
    s2 = scales.reshape(n, o, g)
    o2 = out.reshape(n, g * 32, o)
    for i in range(n):
        _dequant_rows(b2[i], s2[i], o2[i])
    return out


# Round-to-nearest onto the E2M1 magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6], ties to the even
# code (IEEE style): the midpoint between codes c and c+1 rounds down when c is even.
_MID_DOWN = np.array([0.25, 1.25, 2.5, 5.0])  # ties go to the lower (even) code
_MID_UP = np.array([0.75, 1.75, 3.5])  # ties go to the upper (even) code


def _quant_rows(w_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w_t float [O, I] (I % 32 == 0) -> blocks uint8 [O, I/32, 16], scales uint8 [O, I/32]."""
    o, i = w_t.shape
    x = w_t.astype(np.float64).reshape(o, i // 32, 32)
    amax = np.max(np.abs(x), axis=-1)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax / 6.0))
    e = np.where(amax > 0, e, -127.0)
    # Guard against log2 rounding: make sure amax / 2**e <= 6.
    e = np.where(amax / np.ldexp(1.0, e.astype(np.int64)) > 6.0, e + 1, e)
    s = np.clip(e + 127, 0, 254).astype(np.int64)
    y = np.abs(x) / np.ldexp(1.0, (s - 127))[..., None]
    code = np.zeros(y.shape, np.uint8)
    for m in _MID_DOWN:
        code += y > m
    for m in _MID_UP:
        code += y >= m
    code |= np.signbit(x).astype(np.uint8) << 3
    code = code.reshape(o, i // 32, 16, 2)
    blocks = (code[..., 0] | (code[..., 1] << 4)).astype(np.uint8)
    return blocks, s.astype(np.uint8)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., in, out] -> (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32]).

    The inverse layout of :func:`dequantize_mxfp4`. Per 32-element block the scale exponent
    is ceil(log2(amax / 6)) (clamped to [-127, 127]), values round to the nearest E2M1 value
    (ties to even, saturating at +-6). Exact on values that are already MXFP4-representable.
    """
    w = np.asarray(w)
    if w.ndim < 2 or w.shape[-2] % 32:
        raise ValueError(
            f"quantize_mxfp4: expected [..., in, out] with in % 32 == 0, got {w.shape}"
        )
    *lead, i, o = w.shape
    n = math.prod(lead)
    w2 = w.reshape(n, i, o)
    blocks = np.empty((n, o, i // 32, 16), np.uint8)
    scales = np.empty((n, o, i // 32), np.uint8)
    for k in range(n):
        blocks[k], scales[k] = _quant_rows(w2[k].T)
    return blocks.reshape(*lead, o, i // 32, 16), scales.reshape(*lead, o, i // 32)
